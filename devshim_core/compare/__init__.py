"""``devshim compare``: is a model computing the same on this device as on the reference? Layer by layer.

The user's unmodified script runs twice, with the same seeds and data: on the selected plugin's device and on a
reference (the host CPU through ``cpu_reference``, or the same device with every plugin kernel replaced by devshim's
reference kernels). In each run the recorder (:mod:`~devshim_core.compare.recorder`, installed at activation when
``DEVSHIM_COMPARE_DIR`` is set) writes, per rank and per step, a bounded sample of every module's forward output, of
the gradient reaching each output, of each parameter's gradient, of the gradients the optimizer steps with, and of
the parameters after the step (:mod:`~devshim_core.compare.dump`). The two dumps are then paired record by record
and measured (:mod:`~devshim_core.compare.metrics`), and the first record, in the order the run made them, that is
beyond the tolerance of its dtype is reported (:mod:`~devshim_core.compare.report`): in the terminal, as JSON and
as an HTML page. The command is :mod:`~devshim_core.compare.runner`.

Data flows one way: the runner starts the runs; each run's recorder writes its dump; the report reads both dumps.
"""
