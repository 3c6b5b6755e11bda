"""`make soak`: workers resolving a rotating set of models while the soak kills, corrupts and collects.

A controller (this process) drives `--workers` long-lived worker processes over pipes. Each step
is one seeded random action: a batch of concurrent resolves; a SIGKILL of a worker (idle, mid-resolve,
or paused at a named build/publication seam); a corruption of a published artifact (a flipped payload
byte, a truncated payload, a deleted READY.json); junk planted in `tmp/` (a dead builder's staging
directory and a stranger file); `cleanup` of one key; `gc`; or an LRU eviction down to a budget (the
domain's own `max_store_bytes` also makes builds evict). After every step an invariant checker runs:

- every visible artifact (published, not denied) passes FULL_CHECKSUM inspection, unless the soak
  corrupted that very publication (then it must be detected: denied, refused or replaced);
- a FULL_CHECKSUM lease is always bit-exact to the model's reference digest; a metadata-only lease
  that is not bit-exact must be one of the soak's own corruptions (served before detection, documented);
- after `cleanup` or `gc`, no staging directory of a dead builder is left in `tmp/`;
- no worker dies of anything but the soak's own SIGKILLs (a SIGBUS would show here), and no worker
  reports an untyped exception.

The tool reaches the product through its public API (and the named fault seams) only.
The RNG seed is printed; `SOAK_SEED` (or `--seed`) reproduces the sequence of actions.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from host_weight_runtime import (
    ArtifactState,
    CapacityPolicy,
    FilesystemHostWeightStore,
    StoreStatus,
    ValidationLevel,
)

from .common import JsonValue, remove_tree
from .preimported import preimported_context
from .soak_worker import (
    REPLY_TIMEOUT_S,
    SoakModel,
    diffusers_models,
    diffusers_references,
    synthetic_references,
    worker_main,
)

__all__ = ["SoakOptions", "SoakSummary", "main", "run_soak"]

ENV_SECONDS = "SOAK_SECONDS"
ENV_SEED = "SOAK_SEED"
ENV_WORKERS = "SOAK_WORKERS"
MIB = 1 << 20
_BUILD_SEAMS = (
    "build.staging_created",
    "publication.before_manifest",
    "publication.after_manifest",
    "publication.after_ready",
    "publication.after_harden",
    "publication.after_rename",
)
_STAGING = re.compile(r"^(?P<key>[0-9a-f]{64})\.(?P<pid>\d+)\.[0-9a-f]+$")
ACTIONS = ("resolve", "kill", "kill_mid_build", "corrupt", "junk", "cleanup", "gc", "evict")
_WEIGHTS = (40, 6, 6, 16, 5, 9, 9, 9)
CORRUPTIONS = ("flip_byte", "truncate", "delete_ready")


@dataclass(frozen=True, slots=True)
class SoakOptions:
    """How long and how hard to soak; `steps` (if set) ends the run after that many steps."""

    seconds: float = 1800.0
    workers: int = 3
    seed: int | None = None
    synthetic_models: int = 4
    diffusers_models: int = 2
    steps: int | None = None
    workdir: Path | None = None

    def __post_init__(self) -> None:
        if not self.seconds > 0:
            raise ValueError(f"the soak needs a positive duration (SOAK_SECONDS), got {self.seconds}")
        if self.workers < 1:
            raise ValueError(f"the soak needs at least one worker (SOAK_WORKERS), got {self.workers}")
        if self.synthetic_models < 1 or self.diffusers_models < 0:
            raise ValueError("--synthetic-models must be at least 1 and --diffusers-models at least 0")


@dataclass(slots=True)
class SoakSummary:
    """What one soak did and found; `violations` must stay empty."""

    seed: int
    steps: int = 0
    resolves: int = 0
    hits: int = 0
    builds: int = 0
    fallbacks: int = 0
    kills: int = 0
    kills_mid_build: int = 0
    corruptions_injected: int = 0
    corruptions_detected: int = 0
    served_before_detection: int = 0
    background_denials: int = 0
    cleanups: int = 0
    gcs: int = 0
    evictions: int = 0
    junk_planted: int = 0
    actions: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    def to_dict(self) -> dict[str, JsonValue]:
        return {
            "seed": self.seed,
            "steps": self.steps,
            "resolves": self.resolves,
            "hits": self.hits,
            "builds": self.builds,
            "fallbacks": self.fallbacks,
            "kills": self.kills,
            "kills_mid_build": self.kills_mid_build,
            "corruptions_injected": self.corruptions_injected,
            "corruptions_detected": self.corruptions_detected,
            "served_before_detection": self.served_before_detection,
            "background_denials": self.background_denials,
            "cleanups": self.cleanups,
            "gcs": self.gcs,
            "evictions": self.evictions,
            "junk_planted": self.junk_planted,
            "actions": dict(sorted(self.actions.items())),
            "violations": list(self.violations),
            "invariant_violations": len(self.violations),
            "wall_s": round(self.wall_s, 3),
        }

    def text(self) -> str:
        return (
            f"soak seed {self.seed}: {self.steps} steps in {self.wall_s:.1f} s\n"
            f"  resolves {self.resolves} (hits {self.hits}, builds {self.builds}, fallbacks {self.fallbacks})\n"
            f"  kills {self.kills} ({self.kills_mid_build} mid-build)\n"
            f"  corruptions injected {self.corruptions_injected}, detected {self.corruptions_detected} "
            f"(served before detection, metadata-only: {self.served_before_detection}; "
            f"denied by background verification: {self.background_denials})\n"
            f"  cleanups {self.cleanups}, gc {self.gcs}, evictions {self.evictions}, junk planted {self.junk_planted}\n"
            f"  invariant violations {len(self.violations)}"
            + "".join(f"\n    - {violation}" for violation in self.violations[:20])
        )


# --------------------------------------------------------------------------- the controller


class _Worker:
    """One spawned worker and our end of its pipe."""

    def __init__(self, context: Any, root: Path) -> None:
        self.conn, child = context.Pipe()
        self.process = context.Process(target=worker_main, args=(str(root), child), daemon=True)
        self.process.start()
        child.close()
        self.killed = False
        try:
            ready = self.recv()
        except EOFError:
            self.process.join(REPLY_TIMEOUT_S)
            raise RuntimeError(
                f"soak worker failed to start (exit code {self.process.exitcode}); its stderr above says why"
            ) from None
        if not isinstance(ready, dict) or "ready" not in ready:
            raise RuntimeError(f"soak worker failed to start: {ready!r}")

    def recv(self) -> Any:
        if not self.conn.poll(REPLY_TIMEOUT_S):
            raise RuntimeError(f"soak worker {self.process.pid} did not answer within {REPLY_TIMEOUT_S:.0f} s")
        return self.conn.recv()

    def kill(self) -> None:
        self.killed = True
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(REPLY_TIMEOUT_S)
        self.conn.close()

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.conn.send({"op": "stop"})
        self.process.join(REPLY_TIMEOUT_S)
        if self.process.is_alive():
            self.kill()


@dataclass(slots=True)
class _Corruption:
    key: str
    publication_id: str
    kind: str
    detected: bool = False


class _Soak:
    """The controller's state: workers, models, references and what the soak itself corrupted."""

    def __init__(self, options: SoakOptions, root: Path, models: list[SoakModel], rng: random.Random) -> None:
        self.options = options
        self.root = root
        self.models = models
        self.rng = rng
        self.context = preimported_context()  # workers start in milliseconds, so a kill costs no import
        self.summary = SoakSummary(seed=0)
        self.references: dict[str, str] = {}  # model name -> reference digest
        self.corruptions: list[_Corruption] = []
        self.store = FilesystemHostWeightStore(root)
        self.workers: list[_Worker] = [_Worker(self.context, root) for _ in range(options.workers)]

    # ---------------------------------------------------------------- helpers

    def violation(self, text: str) -> None:
        self.summary.violations.append(f"step {self.summary.steps}: {text}")

    def _replace(self, index: int) -> None:
        self.workers[index] = _Worker(self.context, self.root)

    def _check_dead(self, index: int, what: str) -> None:
        """A worker whose pipe broke without our SIGKILL died of something else: a violation."""
        worker = self.workers[index]
        worker.process.join(REPLY_TIMEOUT_S)
        if not worker.killed:
            self.violation(f"worker {worker.process.pid} died during {what} with exit code {worker.process.exitcode}")
        self._replace(index)

    def _published_id(self, key: str) -> str | None:
        try:
            value = json.loads((self.store.layout.artifact_dir(key) / "READY.json").read_bytes())["publication_id"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return value if isinstance(value, str) else None

    def _visible_keys(self) -> list[str]:
        try:
            return sorted(name for name in os.listdir(self.store.layout.artifacts) if len(name) == 64)
        except OSError:
            return []

    def _corrupted(self, key: str, publication_id: str | None) -> _Corruption | None:
        """The soak's undetected corruption of this publication (any of the key's when READY.json is gone)."""
        return next(
            (
                c
                for c in self.corruptions
                if c.key == key and not c.detected and (publication_id is None or c.publication_id == publication_id)
            ),
            None,
        )

    # ---------------------------------------------------------------- actions

    def resolve(self) -> None:
        requests: list[tuple[int, SoakModel, ValidationLevel]] = []
        for index, worker in enumerate(self.workers):
            model = self.rng.choice(self.models)
            validation = self.rng.choice(list(ValidationLevel))
            try:
                worker.conn.send({"model": model.to_dict(), "validation": validation.value})
            except OSError:
                self._check_dead(index, "a resolve")
                continue
            requests.append((index, model, validation))
        for index, model, validation in requests:
            try:
                reply = self.workers[index].recv()
            except (EOFError, OSError):
                self._check_dead(index, "a resolve")
                continue
            self._judge(model, validation, reply)

    def _judge(self, model: SoakModel, validation: ValidationLevel, reply: dict[str, Any]) -> None:
        summary = self.summary
        summary.resolves += 1
        if "error" in reply:
            self.violation(f"{model.name}: untyped exception in a worker:\n{reply['error']}")
            return
        status = reply["status"]
        if status in (StoreStatus.HIT.value, StoreStatus.JOINED.value):
            summary.hits += 1
        elif status == StoreStatus.BUILT.value:
            summary.builds += 1
        else:
            summary.fallbacks += 1
        if reply["verification"] == "denied":
            summary.background_denials += 1
        digest = reply["digest"]
        if digest is None:
            return
        if digest == self.references[model.name]:
            return
        corrupted = self._corrupted(reply["key"], reply["publication_id"]) if reply["key"] else None
        if validation is ValidationLevel.FULL_CHECKSUM and status != "fallback":
            self.violation(f"{model.name}: a FULL_CHECKSUM lease served bytes that differ from the reference")
        elif corrupted is not None:
            summary.served_before_detection += 1
        else:
            self.violation(f"{model.name}: served bytes differ from the reference ({status}, {validation.value})")

    def kill(self, *, mid_build: bool) -> None:
        index = self.rng.randrange(len(self.workers))
        worker = self.workers[index]
        model = self.rng.choice([m for m in self.models if m.folder is None])
        request: dict[str, Any] = {"model": model.to_dict(), "validation": ValidationLevel.MANIFEST_AND_METADATA.value}
        if mid_build:
            self.store.cleanup(model.identity().key)  # make the next resolve build (unless a lease holds it)
            request["pause_at"] = self.rng.choice(_BUILD_SEAMS)
        try:
            worker.conn.send(request)
            if mid_build:
                reply = worker.recv()
                if "paused" in reply:
                    self.summary.kills_mid_build += 1
                else:
                    self._judge(model, ValidationLevel.MANIFEST_AND_METADATA, reply)
        except (EOFError, OSError):
            self._check_dead(index, "a kill")
            return
        worker.kill()
        self.summary.kills += 1
        if worker.process.exitcode != -signal.SIGKILL:
            self.violation(f"worker {worker.process.pid} ended with {worker.process.exitcode}, not our SIGKILL")
        self._replace(index)

    def corrupt(self) -> None:
        keys = [key for key in self._visible_keys() if not os.path.lexists(self.store.layout.deny_marker(key))]
        if not keys:
            return
        key = self.rng.choice(keys)
        publication_id = self._published_id(key)
        directory = self.store.layout.artifact_dir(key)
        payloads = sorted(path for path in directory.iterdir() if path.name.endswith(".safetensors"))
        if publication_id is None or not payloads:
            return
        kind = self.rng.choice(CORRUPTIONS)
        target = self.rng.choice(payloads)
        os.chmod(directory, 0o755)
        try:
            if kind == "delete_ready":
                (directory / "READY.json").unlink()
            else:
                os.chmod(target, 0o644)
                try:
                    size = target.stat().st_size
                    header = 8 + int.from_bytes(target.read_bytes()[:8], "little")
                    if kind == "truncate":
                        os.truncate(target, self.rng.randrange(header, size))
                    else:
                        offset = self.rng.randrange(header, size)
                        with target.open("r+b") as handle:
                            handle.seek(offset)
                            byte = handle.read(1)
                            handle.seek(offset)
                            handle.write(bytes([byte[0] ^ (1 << self.rng.randrange(8))]))
                finally:
                    os.chmod(target, 0o444)
        finally:
            os.chmod(directory, 0o555)
        self.corruptions.append(_Corruption(key, publication_id, kind))
        self.summary.corruptions_injected += 1

    def junk(self) -> None:
        """A dead builder's staging directory (gc must remove it) and a stranger file (left alone)."""
        done = subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
        )
        dead_pid = int(done.stdout.strip())
        key = self.rng.choice(self.models).identity().key
        staging = self.store.layout.tmp / f"{key}.{dead_pid}.{self.rng.getrandbits(48):012x}"
        staging.mkdir(mode=0o700)
        (staging / "model.safetensors").write_bytes(self.rng.randbytes(4096))
        (self.store.layout.tmp / f"junk-{self.rng.getrandbits(32):08x}").write_bytes(b"not ours")
        self.summary.junk_planted += 1

    def cleanup(self) -> None:
        keys = self._visible_keys() or [self.rng.choice(self.models).identity().key]
        key = self.rng.choice(keys)
        self.store.cleanup(key)
        self.summary.cleanups += 1
        self._check_leftovers(key)

    def gc(self, *, evict: bool) -> None:
        if evict:
            usage = self.store.usage()
            budget = int(usage.store_bytes * self.rng.uniform(0.3, 0.9)) if usage.store_bytes else None
            plan = self.store.plan_gc(max_bytes=budget, quarantine_older_than_s=0.0)
            self.summary.evictions += 1
        else:
            plan = self.store.plan_gc(quarantine_older_than_s=0.0)
            self.summary.gcs += 1
        self.store.execute_gc(plan, deadline=time.monotonic() + 30.0)
        self._check_leftovers(None)

    # ---------------------------------------------------------------- invariants

    def _check_leftovers(self, key: str | None) -> None:
        """No staging directory of a dead builder survives `cleanup` (of its key) or `gc` (of any key)."""
        for name in os.listdir(self.store.layout.tmp):
            match = _STAGING.match(name)
            if match is None or (key is not None and match["key"] != key):
                continue
            if not _alive(int(match["pid"])):
                self.violation(f"a dead builder's staging directory survived {'cleanup' if key else 'gc'}: {name}")

    def check(self) -> None:
        """Every visible artifact verifies fully, or is one of the soak's own corruptions (and is tracked)."""
        for corruption in self.corruptions:
            if corruption.detected:
                continue
            denied = os.path.lexists(self.store.layout.deny_marker(corruption.key))
            present = os.path.lexists(self.store.layout.artifact_dir(corruption.key))
            current = self._published_id(corruption.key)  # None while READY.json is deleted
            if denied or not present or (current is not None and current != corruption.publication_id):
                corruption.detected = True
                self.summary.corruptions_detected += 1
        for key in self._visible_keys():
            if os.path.lexists(self.store.layout.deny_marker(key)):
                continue
            inspection = self.store.inspect_artifact(key, validation=ValidationLevel.FULL_CHECKSUM)
            if inspection.state is ArtifactState.READY:
                continue
            if inspection.state is ArtifactState.MISSING:
                continue  # removed between the listing and the inspection (an eviction in a worker's build)
            if self._corrupted(key, inspection.publication_id or self._published_id(key)) is None:
                problem = None if inspection.problem is None else inspection.problem.message
                self.violation(
                    f"artifact {key[:16]}... is {inspection.state.value} and the soak did not do it: {problem}"
                )

    def finish(self) -> None:
        """Every model once more with FULL_CHECKSUM, so every corruption still visible is detected."""
        for model in self.models:
            worker = self.workers[0]
            try:
                worker.conn.send({"model": model.to_dict(), "validation": ValidationLevel.FULL_CHECKSUM.value})
                self._judge(model, ValidationLevel.FULL_CHECKSUM, worker.recv())
            except (EOFError, OSError):
                self._check_dead(0, "the final pass")
        self.check()
        for corruption in self.corruptions:
            if not corruption.detected:
                # a corrupted artifact nobody asked for again (a diffusers key is resolved at META): refuse it now
                result = self.store.inspect_artifact(corruption.key, validation=ValidationLevel.FULL_CHECKSUM)
                if result.state is ArtifactState.READY:
                    self.violation(f"corruption {corruption.kind} of {corruption.key[:16]}... passes FULL_CHECKSUM")
                else:
                    corruption.detected = True
                    self.summary.corruptions_detected += 1

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()
            if worker.process.exitcode not in (0, -signal.SIGKILL) and not worker.killed:
                self.violation(f"worker {worker.process.pid} exited with {worker.process.exitcode}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_soak(options: SoakOptions, say: Callable[[str], None] = lambda _line: None) -> SoakSummary:
    """Soak a fresh domain under /dev/shm (or `workdir`) for `options.seconds` (or `options.steps`)."""
    seed = options.seed if options.seed is not None else random.SystemRandom().randrange(1 << 32)
    say(f"soak seed {seed} (SOAK_SEED={seed} reproduces the sequence of actions)")
    rng = random.Random(seed)
    parent = options.workdir or (Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir()))
    workdir = Path(tempfile.mkdtemp(prefix="hwr-soak-", dir=parent))
    started = time.monotonic()
    soak: _Soak | None = None
    try:
        synthetic = [
            SoakModel(index, size_mib=1 + index % 2, seed=1000 + index) for index in range(options.synthetic_models)
        ]
        diffusers = diffusers_models(options.diffusers_models, workdir / "pipelines", len(synthetic))
        models = synthetic + diffusers
        root = workdir / "domain"
        total = sum(model.size_mib for model in synthetic) * MIB + len(diffusers) * 2 * MIB
        FilesystemHostWeightStore(root, capacity=CapacityPolicy(max_store_bytes=max(2 * MIB, int(total * 0.7))))
        soak = _Soak(options, root, models, rng)
        soak.summary.seed = seed
        soak.references.update(synthetic_references(synthetic, workdir))
        soak.references.update(diffusers_references(diffusers))
        say(f"soak: {len(models)} models, {options.workers} workers, domain {root}")
        deadline = started + options.seconds
        while time.monotonic() < deadline and (options.steps is None or soak.summary.steps < options.steps):
            # the first steps do each kind of action once, so even a short soak covers them all
            action = (
                ACTIONS[soak.summary.steps] if soak.summary.steps < len(ACTIONS) else rng.choices(ACTIONS, _WEIGHTS)[0]
            )
            soak.summary.steps += 1
            soak.summary.actions[action] = soak.summary.actions.get(action, 0) + 1
            if action == "resolve":
                soak.resolve()
            elif action in ("kill", "kill_mid_build"):
                soak.kill(mid_build=action == "kill_mid_build")
            elif action == "corrupt":
                soak.corrupt()
            elif action == "junk":
                soak.junk()
            elif action == "cleanup":
                soak.cleanup()
            else:
                soak.gc(evict=action == "evict")
            soak.check()
            if soak.summary.steps % 100 == 0:
                say(f"soak: {soak.summary.steps} steps, {len(soak.summary.violations)} violations")
        soak.finish()
        return soak.summary
    finally:
        if soak is not None:
            soak.close()
            soak.summary.wall_s = time.monotonic() - started
        remove_tree(workdir)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m hwr_tools.soak [--seconds N] [--workers N] [--seed N] [--json]`."""
    parser = argparse.ArgumentParser(prog="hwr-soak", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=float(os.environ.get(ENV_SECONDS, "1800")))
    parser.add_argument("--workers", type=int, default=int(os.environ.get(ENV_WORKERS, "3")))
    parser.add_argument("--seed", type=int, default=int(os.environ[ENV_SEED]) if os.environ.get(ENV_SEED) else None)
    parser.add_argument("--steps", type=int, default=None, help="stop after this many steps")
    parser.add_argument("--synthetic-models", type=int, default=4)
    parser.add_argument("--diffusers-models", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args(argv)
    try:
        options = SoakOptions(
            seconds=args.seconds,
            workers=args.workers,
            seed=args.seed,
            synthetic_models=args.synthetic_models,
            diffusers_models=args.diffusers_models,
            steps=args.steps,
        )
    except ValueError as exc:
        parser.error(str(exc))
    summary = run_soak(options, say=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps(summary.to_dict(), indent=2) if args.json else summary.text())
    return 0 if not summary.violations else 1


if __name__ == "__main__":
    sys.exit(main())
