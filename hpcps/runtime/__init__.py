"""One run at work: the ranks' roles (servers, group servers, workers), start-up agreement,
the step API's sessions, evaluation, checkpoints, signals, faults and teardown (MPI mechanism,
over the policies' pure decisions)."""
