"""API keys and what each may do: the --api-key-file format and the table the public port reads.

One key per line, then its attributes, separated by spaces; blank lines and `#` lines skipped:

    # KEY                      attributes (all optional)
    key-team-a-0123456789abcd  salt=team-a
    key-team-a-fedcba98765432  salt=team-a  priority=-10..10
    key-ops-0123456789abcdef   admin

- `salt=NAME`: the key's prefix-cache salt. A cached prompt block is found only by requests of
  the same salt (it enters the first block's hash, vLLM's `cache_salt` idea), so one tenant's
  cache hits, `usage.cached_prompt_tokens` included, never reveal another's prompt. Keys given
  the same NAME share their cached prompts; a key without one shares with no other key.
- `admin`: may call the operator's methods (ADMIN_METHODS: the KV events stream, which carries
  every cached prompt's token ids, FlushCache, which empties everyone's cache, and
  Load/UnloadLoraAdapter, which read a path of the caller's choice on the workers); other keys
  get PERMISSION_DENIED.
- `priority=LO..HI`: the priorities its requests may ask for (lower is served first; the
  default 0). Without it a key may ask for 0 or later, never ahead of the default. A request
  that names no priority (every API but Generation's Generate) runs at 0 moved into the range.

Without --api-key-file everyone is one caller (OPEN_POLICY): no salt, every method, any
priority, as before keys existed.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from engine_common.request.params import ParamError

MIN_KEY_CHARS = 16
# A key travels in a gRPC header, refused past 8-16 KiB of metadata: a longer key was loaded,
# then no client could ever send it.
MAX_KEY_CHARS = 1024
_KEY_CHARS = frozenset(chr(c) for c in range(0x21, 0x7f))
INT32_MIN, INT32_MAX = -2**31, 2**31 - 1

# Methods only a key marked `admin` may call (with --api-key-file).
ADMIN_METHODS = frozenset({"/vllm.grpc.engine.VllmEngine/SubscribeKvEvents",
                           "/vllm.grpc.engine.VllmEngine/FlushCache",
                           "/deltaserve.v1.Generation/LoadLoraAdapter",
                           "/deltaserve.v1.Generation/UnloadLoraAdapter"})


def fingerprint(header: str) -> str:
    """Names an authorization header (a key) without holding it."""
    return hashlib.sha256(header.encode(errors="replace")).hexdigest()[:16]


@dataclass(frozen=True)
class KeyPolicy:
    """What calls made with one key may do."""

    salt: str = ""              # prefix-cache salt ("" : the unsalted cache of the open mode)
    admin: bool = True
    min_priority: int = INT32_MIN
    max_priority: int = INT32_MAX

    def check_priority(self, priority: int) -> None:
        """ParamError unless `priority` is within this key's range."""
        if not self.min_priority <= priority <= self.max_priority:
            raise ParamError("priority", priority, f"in [{self.min_priority}, "
                             f"{self.max_priority}] for this API key (its priority= in the "
                             "server's --api-key-file)")

    @property
    def default_priority(self) -> int:
        """The priority of a request that names none (VllmEngine's Generate, Embed, Classify,
        Score): 0 moved into this key's range, so no API runs a key outside it."""
        return min(max(0, self.min_priority), self.max_priority)


OPEN_POLICY = KeyPolicy()


class KeyBook:
    """fingerprint(`Bearer <key>`) -> KeyPolicy; None: the open mode (no key file)."""

    def __init__(self, policies: dict[str, KeyPolicy] | None = None):
        self.policies = policies

    @property
    def open(self) -> bool:
        return self.policies is None

    def policy_of(self, header: str | None) -> KeyPolicy | None:
        """The policy of an authorization header's key; None for no or an unknown key (with keys)."""
        if self.policies is None:
            return OPEN_POLICY
        return self.policies.get(fingerprint(header)) if header else None


def load_api_keys(path: str) -> KeyBook:
    """The keys of an API key file (format above). ParamError names the file and the line of a
    key that is too short or not printable ASCII, or of an attribute that is not one of these."""
    policies = {}
    with open(path, encoding="ascii", errors="replace") as f:
        for number, line in enumerate(f, 1):
            words = line.split()
            if not words or words[0].startswith("#"):
                continue
            key, where = words[0], f"{path}:{number}"
            if not (MIN_KEY_CHARS <= len(key) <= MAX_KEY_CHARS and set(key) <= _KEY_CHARS):
                raise ParamError("api_key_file", where, f"one key per line, each at least "
                                 f"{MIN_KEY_CHARS} printable ASCII characters without spaces, "
                                 f"at most {MAX_KEY_CHARS} (a key travels in a gRPC header)")
            name = fingerprint(f"Bearer {key}")
            policies[name] = _policy(words[1:], f"key:{name}", where)
    if not policies:
        raise ParamError("api_key_file", path, "a file holding at least one key")
    return KeyBook(policies)


def _policy(attributes: list[str], own_salt: str, where: str) -> KeyPolicy:
    """A key's policy from its attributes; its own salt unless `salt=` names a shared one."""
    fields = {"salt": own_salt, "admin": False, "min_priority": 0, "max_priority": INT32_MAX}
    for word in attributes:
        name, _, value = word.partition("=")
        if word == "admin":
            fields["admin"] = True
        elif name == "salt" and value:
            fields["salt"] = f"name:{value}"
        elif name == "priority":
            fields["min_priority"], fields["max_priority"] = _priority_range(value, where)
        else:
            raise ParamError("api_key_file", where, f"attributes `admin`, `salt=NAME` or "
                             f"`priority=LO..HI` after the key, not {word[:100]!r}")
    return KeyPolicy(**fields)


def _priority_range(text: str, where: str) -> tuple[int, int]:
    low, sep, high = text.partition("..")
    try:
        lo, hi = int(low), int(high)
    except ValueError:
        lo, hi = 1, 0
    if not sep or not INT32_MIN <= lo <= hi <= INT32_MAX:
        raise ParamError("api_key_file", where, f"priority=LO..HI with integers "
                         f"{INT32_MIN} <= LO <= HI <= {INT32_MAX}, not {text[:100]!r}")
    return lo, hi
