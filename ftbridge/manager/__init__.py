"""The replica manager: torchft's quorum, the cross-replica process group, heals, for one rank.

:class:`ReplicaManager` is what the rest of ftbridge uses (the engine, the
gradient sync, the checkpointer through the engine): its methods cover the
step (quorum, all-reduce, heal agreement, commit) and its state (counters for
heal and checkpoint). The torchft object it wraps is private.

This package is torchft's one door: only :mod:`ftbridge.manager.torchft_api`
imports torchft (``tests/test_boundaries.py``; the graph is in
``docs/concepts.md``), and torchft's private fields are read only here, under
that module's version check. Its modules:

* :mod:`~ftbridge.manager.commit`: the per-step commit protocol as pure functions (its drivers are below);
* :mod:`~ftbridge.manager.replica`: :class:`ReplicaManager`;
* :mod:`~ftbridge.manager.quorum_guard`: surviving lighthouse restarts (wraps torchft's manager client);
* :mod:`~ftbridge.manager.heal_agreement`: a rank's heal state, settled by the group's decision;
* :mod:`~ftbridge.manager.store_probe`: deadlines on calls to a TCPStore that may be hung, and
  torchft's process groups that probe it before they rendezvous;
* :mod:`~ftbridge.manager.transport`: the pickle-free heal transport torchft's ``Manager`` drives;
* :mod:`~ftbridge.manager.quorum_watch`: the peer watch (cut a hung peer off once the lighthouse holds it dead);
* :mod:`~ftbridge.manager.outage`: the QUORUM and AGREE drivers: riding out a lighthouse that does not
  answer, and the agreement every step;
* :mod:`~ftbridge.manager.lighthouse_monitor`: whether the lighthouse answers, by answers within a deadline.
"""

from ftbridge.manager.heal_agreement import HealAgreement
from ftbridge.manager.replica import ReplicaManager, is_dummy_work

__all__ = ["HealAgreement", "ReplicaManager", "is_dummy_work"]
