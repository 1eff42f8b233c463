"""``hpcps check``, the self-check of an allocation: its measurements (:mod:`~hpcps.check.probe`, MPI), what
they mean (:mod:`~hpcps.check.findings`, pure) and the run of both under the job's launcher
(:mod:`~hpcps.check.run`)."""
