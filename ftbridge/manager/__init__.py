"""The replica manager: torchft's quorum, the cross-replica process group and heals, for one rank.

:class:`ReplicaManager` is what the rest of ftbridge uses. Only :mod:`~ftbridge.manager.torchft_api`
imports torchft, and torchft's private fields are used only in this package, under its version check.
Modules: :mod:`~ftbridge.manager.commit` (the commit protocol, pure), :mod:`~ftbridge.manager.replica`,
:mod:`~ftbridge.manager.outage` (QUORUM and AGREE drivers), :mod:`~ftbridge.manager.quorum_guard` and
:mod:`~ftbridge.manager.quorum_rules` (lighthouse restarts), :mod:`~ftbridge.manager.quorum_watch` (the
peer watch), :mod:`~ftbridge.manager.heal_agreement`, :mod:`~ftbridge.manager.transport` (heals),
:mod:`~ftbridge.manager.store_probe`, :mod:`~ftbridge.manager.lighthouse_monitor`,
:mod:`~ftbridge.manager.stand_aside`.
"""

from ftbridge.manager.heal_agreement import HealAgreement
from ftbridge.manager.replica import ReplicaManager, is_dummy_work

__all__ = ["HealAgreement", "ReplicaManager", "is_dummy_work"]
