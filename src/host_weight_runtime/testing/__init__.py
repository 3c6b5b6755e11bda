"""Test helpers for people who implement or extend Host Weight Runtime stores.

`host_weight_runtime.testing.store_conformance.HostWeightStoreConformance` is a
pytest base class that any `HostWeightStore` implementation subclasses to prove it
honours the store contract. That module imports pytest (a test extra), so this
package deliberately imports nothing from it: `import host_weight_runtime` and
`import host_weight_runtime.testing` both work without pytest installed; only the
conformance module itself needs it, and users import it only from their tests.
"""

from __future__ import annotations

__all__: list[str] = []
