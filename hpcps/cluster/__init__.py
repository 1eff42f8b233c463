"""Where the ranks are and what they are: the layout of roles, their placement on nodes, the
communicators, devices, launcher checks, speed groups and emulated compute time."""
