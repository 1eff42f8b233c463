"""The local-SGD family's presets: ``localsgd`` and ``diloco``, lock-step outer rounds.

In the family (Stich 2019; DiLoCo, Douillard et al. 2023) each worker takes
H local steps with an inner optimizer of its own, then pushes the change of
its parameters over the round, a *pseudo-gradient*; the shards apply the
average with the outer optimizer, which is the server's optimizer hpcps has
always had (``--optimizer``, ``--lr``, ...). The worker side is
:mod:`hpcps.training.local`, turned on by ``--local-steps H``.

What decides when a pseudo-gradient is applied and who waits is the
paradigm's rule over the workers' clocks, which now count outer rounds, so
the family is not a rule of its own but ``--local-steps`` on the clock
paradigms: ``bsp`` (lock-step rounds), ``ssp`` and ``dssp`` (rounds bounded
by ``--staleness``, fixed or dynamic) and ``asp`` (each pseudo-gradient
applied on arrival, as in asynchronous local SGD). The two names here are
bsp's rule with the outer optimizer of their papers where the user sets
none (:data:`hpcps.options.config.FAMILY_OUTER`) and ``--local-steps`` 8 by
default:

* ``localsgd``: the outer step averages (sgd at rate 1, no momentum): the
  new parameters are the mean of the workers' local ones.
* ``diloco``: Nesterov sgd outside (rate 0.7, momentum 0.9).
"""

from __future__ import annotations

from hpcps.policies.registry import register
from hpcps.policies.sync import BSP


@register
class LocalSGD(BSP):
    name = "localsgd"
    summary = "local SGD: --local-steps H inner steps per worker, then the average of their parameters"


@register
class DiLoCo(BSP):
    name = "diloco"
    summary = "DiLoCo: --local-steps H inner steps per worker, their mean change stepped by Nesterov sgd"
