"""The replica manager: torchft's quorum, the cross-replica process group and heals, for one rank.

:class:`ReplicaManager` is what the rest of ftbridge uses; :mod:`~ftbridge.manager.commit` holds the
commit protocol's rules and :mod:`~ftbridge.manager.torchft_api` is the only importer of torchft.
"""

from ftbridge.manager.heal_agreement import HealAgreement
from ftbridge.manager.replica import ReplicaManager, is_dummy_work

__all__ = ["HealAgreement", "ReplicaManager", "is_dummy_work"]
