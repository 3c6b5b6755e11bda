"""Where everything lives in a domain.

    <root>/
      domain.json                 uuid, scope, domain id, storage class, detected fs type
      domain-policy.json          capacity policy; the first writer's policy is authoritative
      locks/
        domain-init.lock          held while the domain's directories and files are created
        capacity.lock             exclusive around a build's capacity check, eviction and preallocation
        <key>.build.lock          exclusive: one builder per key
        <key>.artifact.lock       shared by every live lease; exclusive to publish or remove;
                                  its mtime is the artifact's last use (touched when a lease opens and closes)
        <key>.verify.lock         exclusive while one process verifies the artifact in the background
      artifacts/<key>/            a published artifact (dir 0555, files 0444)
        READY.json                written last; names the manifest's digest
        manifest.json             identity, per-tensor and per-file digests, content digest
        *.safetensors             payloads, readable by stock safetensors
      tmp/<key>.<pid>.<rand>/     builds in progress; invisible to readers
      tmp/evicting-<key>.<pid>.<rand>/  an evicted artifact being deleted (moved out of artifacts/ first)
      quarantine/<key>.<ns>.<rand>/  invalid or colliding artifacts, kept for inspection
      deny/<key>.json             "this artifact failed validation"
      verified/<key>.json         "this publication was fully hashed on this node" (background verification)
      source-digests-v1/          node cache of checkpoint-file hashes (diffusion adapters);
        entries/, locks/          disposable: a missing or corrupt entry is simply recomputed
      publishing-v1/<key>.json    progress of a background publication, so a worker arriving meanwhile
                                  can take whichever is sooner (diffusion adapters); advisory, removed
                                  when the build ends
      named-snapshots-v1/         a load by name: the non-weight files (configs, tokenizers) of snapshots
                                  this node holds no checkpoint of, fetched from a remote and checked by
                                  SHA-256 (diffusion adapters); disposable, fetched again when missing

Lock files live outside the artifact directories and are never unlinked.
"""

from __future__ import annotations

import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

DOMAIN_FILE = "domain.json"
POLICY_FILE = "domain-policy.json"
LOCKS_DIR = "locks"
ARTIFACTS_DIR = "artifacts"
TMP_DIR = "tmp"
QUARANTINE_DIR = "quarantine"
DENY_DIR = "deny"
VERIFIED_DIR = "verified"
DOMAIN_INIT_LOCK = "domain-init.lock"
CAPACITY_LOCK = "capacity.lock"
EVICTING_PREFIX = "evicting-"
STORE_DIRS = (LOCKS_DIR, ARTIFACTS_DIR, TMP_DIR, QUARANTINE_DIR, DENY_DIR, VERIFIED_DIR)

_KEY_PATTERN = re.compile(r"^[0-9a-f]{64}$")


def is_key(name: str) -> bool:
    """Whether a directory entry's name is an artifact key (so a planted stranger is skipped)."""
    try:
        check_key(name)
    except ValueError:
        return False
    return True


def check_key(key: str) -> str:
    """Accept only identity keys (64 lowercase hex characters), so a key is always a safe name."""
    if not isinstance(key, str) or not _KEY_PATTERN.match(key):
        raise ValueError(f"artifact key must be 64 lowercase hex characters, got {key!r}")
    return key


@dataclass(frozen=True, slots=True)
class DomainLayout:
    """Paths of one domain; pure path arithmetic, no I/O."""

    root: Path

    @property
    def domain_file(self) -> Path:
        return self.root / DOMAIN_FILE

    @property
    def policy_file(self) -> Path:
        return self.root / POLICY_FILE

    @property
    def locks(self) -> Path:
        return self.root / LOCKS_DIR

    @property
    def artifacts(self) -> Path:
        return self.root / ARTIFACTS_DIR

    @property
    def tmp(self) -> Path:
        return self.root / TMP_DIR

    @property
    def quarantine(self) -> Path:
        return self.root / QUARANTINE_DIR

    @property
    def deny(self) -> Path:
        return self.root / DENY_DIR

    @property
    def verified(self) -> Path:
        return self.root / VERIFIED_DIR

    @property
    def domain_init_lock(self) -> Path:
        return self.locks / DOMAIN_INIT_LOCK

    @property
    def capacity_lock(self) -> Path:
        return self.locks / CAPACITY_LOCK

    def build_lock(self, key: str) -> Path:
        return self.locks / f"{check_key(key)}.build.lock"

    def artifact_lock(self, key: str) -> Path:
        return self.locks / f"{check_key(key)}.artifact.lock"

    def verify_lock(self, key: str) -> Path:
        return self.locks / f"{check_key(key)}.verify.lock"

    def verified_marker(self, key: str) -> Path:
        return self.verified / f"{check_key(key)}.json"

    def artifact_dir(self, key: str) -> Path:
        return self.artifacts / check_key(key)

    def deny_marker(self, key: str) -> Path:
        return self.deny / f"{check_key(key)}.json"

    def new_staging_dir(self, key: str) -> Path:
        return self.tmp / f"{check_key(key)}.{os.getpid()}.{secrets.token_hex(6)}"

    def staging_dirs(self, key: str) -> list[Path]:
        prefix = f"{check_key(key)}."
        try:
            names = os.listdir(self.tmp)
        except FileNotFoundError:
            return []
        return sorted(self.tmp / name for name in names if name.startswith(prefix))

    def quarantined_dirs(self, key: str) -> list[Path]:
        prefix = f"{check_key(key)}."
        try:
            names = os.listdir(self.quarantine)
        except FileNotFoundError:
            return []
        return sorted(self.quarantine / name for name in names if name.startswith(prefix))

    def new_eviction_dir(self, key: str) -> Path:
        """Where an evicted artifact goes before it is deleted; never matches `staging_dirs(key)`."""
        return self.tmp / f"{EVICTING_PREFIX}{check_key(key)}.{os.getpid()}.{secrets.token_hex(6)}"

    def eviction_dirs(self) -> list[Path]:
        try:
            names = os.listdir(self.tmp)
        except FileNotFoundError:
            return []
        return sorted(self.tmp / name for name in names if name.startswith(EVICTING_PREFIX))

    def new_quarantine_dir(self, key: str) -> Path:
        return self.quarantine / f"{check_key(key)}.{time.time_ns()}.{secrets.token_hex(4)}"
