"""The fault suite: each module injects one kind of fault (a rank that disagrees or dies, a broken cache, a flag the
device cannot serve, a symlink, a version that lies) and specifies what the user sees instead of a hang, a crash or a
silent wrong result."""
