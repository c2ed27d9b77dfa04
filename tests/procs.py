"""Process checks the tests share, independent of the library's own helpers."""
import os


def group_gone(pgid: int) -> bool:
    """True when no process is left in process group pgid."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False
