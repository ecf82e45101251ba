"""Framework integrations: each installs its patch sets on top of the device facade."""
