"""kvrelay's pure decision core: no I/O, no clocks, no logging; time comes in as ``now_s``.

One concept per module: ``params`` (vLLM's kv_transfer_params), ``fingerprint`` (proof of the
held tokens), ``conversation`` (what is remembered between turns), ``costs`` (learned
throughput), ``selection`` (which node), ``policy`` (pull, recompute or direct).
"""

from kvrelay.core.conversation import ConversationEntry, ConversationKey, entry_from_decode
from kvrelay.core.costs import BoundedEwma, CostEstimates, PrefillEstimate, TransferEstimate
from kvrelay.core.fingerprint import (
    TokenFingerprint,
    fingerprint_tokens,
    verifiable_tokens,
    verified_prefix_tokens,
)
from kvrelay.core.params import KVParamsError, RemoteBlocks, parse_remote_blocks
from kvrelay.core.policy import PolicyConfig, TurnDecision, decide_turn
from kvrelay.core.selection import (
    AffinityConfig,
    NodeChoice,
    NodeState,
    choose_decode,
    choose_prefill,
)

__all__ = [
    "AffinityConfig",
    "BoundedEwma",
    "ConversationEntry",
    "ConversationKey",
    "CostEstimates",
    "KVParamsError",
    "NodeChoice",
    "NodeState",
    "PolicyConfig",
    "PrefillEstimate",
    "RemoteBlocks",
    "TokenFingerprint",
    "TransferEstimate",
    "TurnDecision",
    "choose_decode",
    "choose_prefill",
    "decide_turn",
    "entry_from_decode",
    "fingerprint_tokens",
    "parse_remote_blocks",
    "verifiable_tokens",
    "verified_prefix_tokens",
]
