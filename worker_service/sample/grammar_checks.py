"""Why a grammar mask row leaves a constrained request nothing to sample (GrammarBook fails that
request alone with the message: docs/structured-output.md, "A grammar that fails on the
worker")."""
from __future__ import annotations

import llguidance
import numpy as np


def mask_failure(tokenizer: llguidance.LLTokenizer, bits: np.ndarray, accepting: bool,
                 ids: np.ndarray | None) -> str | None:
    """Why the mask row `bits` (uint32 words) leaves nothing to sample, or None. `accepting`:
    the grammar may end there (its eos is then in the mask); `ids`: the request's
    allowed_token_ids (None: every id)."""
    if not accepting:
        special = only_special(tokenizer, bits)
        if special:
            return (f"its grammar must write {special!r} as text, which the tokenizer reads as "
                    "a special token, so no token may come next (llguidance offers the special "
                    "token instead)")
    if ids is not None and not ((bits[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1).any():
        return ("allowed_token_ids and its grammar leave no token to sample (none of the "
                f"{len(ids)} allowed ids may come next)")
    return None


def only_special(tokenizer: llguidance.LLTokenizer, row: np.ndarray) -> str:
    """The text of the special tokens a mask row allows, when it allows nothing else (""
    otherwise). llguidance (1.9.1) tokenizes forced text with the model's tokenizer, which
    reads "<|im_end|>" as that special token: for a constraint that must write it, the mask
    offers only the special token, an eos id ended the request as a normal STOP_TOKEN with
    text that breaks the constraint, another id failed a step later."""
    words = np.flatnonzero(row)
    if not len(words) or len(words) > 2:
        return ""
    ids = [int(w) * 32 + b for w in words for b in range(32) if int(row[w]) >> b & 1]
    if not all(tokenizer.is_special_token(i) for i in ids):
        return ""
    return "".join(tokenizer.decode_bytes([i]).decode("utf-8", "replace") for i in ids)
