"""A run's checkpoints: the files and what they hold (:mod:`~hpcps.runtime.checkpoints.files`), when the run
writes them (periodic, at a stop, ``--resume auto``: :mod:`~hpcps.runtime.checkpoints.schedule`), the
consistent cut the asynchronous paradigms take while the run goes on (:mod:`~hpcps.runtime.checkpoints.cut`),
and worker 0's loop part of bsp's (:mod:`~hpcps.runtime.checkpoints.loop`)."""
