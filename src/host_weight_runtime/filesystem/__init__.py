"""The store room: the node-local domain of immutable artifacts.

Other rooms use the public modules (`store`, `writer`, `reader`, `domain`, `locks`, `capacity`,
`garbage`, `inspection`) and the names below; every module whose name starts with `_` is private
to this room.
"""

from ._fsutil import (
    create_empty_file,
    errno_name,
    failure_from_os_error,
    read_small_file,
    remove_tree,
    write_file_atomic,
)
from ._layout import DomainLayout, check_key

__all__ = [
    "DomainLayout",
    "check_key",
    "create_empty_file",
    "errno_name",
    "failure_from_os_error",
    "read_small_file",
    "remove_tree",
    "write_file_atomic",
]
