"""A run's options, validated once at the edge (pure: no MPI): the configuration (:mod:`~hpcps.options.config`),
what each option takes effect on and the combinations refused (:mod:`~hpcps.options.effects`), the checks
against the world size and the rank layout (:mod:`~hpcps.options.planning`), and the values of two options
of their own: ``--fault`` (:mod:`~hpcps.options.faults`) and ``--stop-target`` (:mod:`~hpcps.options.targets`)."""
