"""Leases: this runtime's own (one lease type, whichever name imports it)."""

from __future__ import annotations

from ...lease import HostWeightLease, HostWeightLeaseCarrier, LeaseProvenance, MappedHostRegion

__all__ = ["HostWeightLease", "HostWeightLeaseCarrier", "LeaseProvenance", "MappedHostRegion"]
