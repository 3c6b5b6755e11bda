"""The names of the benchmark's rows and page-cache states, shared by the runner, the goals and the report."""

from __future__ import annotations

__all__ = [
    "CANONICAL",
    "CANONICAL_HUB",
    "COLD",
    "COLD_BACKGROUND",
    "COLD_BACKGROUND_HUB",
    "COLD_PUBLISH",
    "COLD_PUBLISH_HUB",
    "COLD_STREAM",
    "COLD_STREAM_HUB",
    "HUB_REPO_ID",
    "HOT",
    "REMOTE_FILE",
    "REMOTE_S3",
    "VIEWS_HUGE",
    "VIEWS_POPULATE_HUGE",
    "VIEWS_POPULATE_SHM",
    "VIEWS_SHM",
    "VIEWS_THREAD_HUGE",
    "VIEWS_THREAD_SHM",
    "WARM_HUGE",
    "WARM_SHM",
    "WARM_VERIFY_OFF",
    "WARM_VERIFY_ON",
]

CANONICAL = "canonical"
COLD_PUBLISH = "hwr cold: canonical + publish"
COLD_STREAM = "hwr cold: streaming producer"
COLD_BACKGROUND = "hwr cold: canonical + background publish"
# The same checkpoint as a Hugging Face cache snapshot, loaded by repo id: blob names are the content ids.
HUB_REPO_ID = "hwr-bench/flux"
CANONICAL_HUB = "canonical (hub cache)"
COLD_PUBLISH_HUB = "hwr cold (hub cache): canonical + publish"
COLD_BACKGROUND_HUB = "hwr cold (hub cache): canonical + background publish"
COLD_STREAM_HUB = "hwr cold (hub cache): streaming producer"
WARM_SHM = "hwr warm: /dev/shm"
WARM_VERIFY_ON = "hwr warm: first lease, background verify on"
WARM_VERIFY_OFF = "hwr warm: background verify off"
WARM_HUGE = "hwr warm: huge-page tmpfs"
VIEWS_SHM = "safetensors-mmap-views: /dev/shm"
VIEWS_HUGE = "safetensors-mmap-views: huge-page tmpfs"
# The same bare views with the page tables filled up front: MAP_POPULATE in mmap, or MADV_POPULATE_READ on a thread.
VIEWS_POPULATE_SHM = "safetensors-mmap-populate: /dev/shm"
VIEWS_POPULATE_HUGE = "safetensors-mmap-populate: huge-page tmpfs"
VIEWS_THREAD_SHM = "safetensors-mmap-prefault-thread: /dev/shm"
VIEWS_THREAD_HUGE = "safetensors-mmap-prefault-thread: huge-page tmpfs"
REMOTE_FILE = "hwr node B: remote import (file://)"
REMOTE_S3 = "hwr node B: remote import (moto S3)"
HOT = "hot"
COLD = "cold"
