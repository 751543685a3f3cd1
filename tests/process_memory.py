"""This test process's memory as Linux counts it (/proc/self/statm), for tests that check what the
emulator maps and commits."""
from cupykv.backends.emulator import memory


def _statm_bytes(field):
    with open("/proc/self/statm", encoding="ascii") as statm:
        return int(statm.read().split()[field]) * memory.PAGE


def mapped_bytes():
    """The process's virtual size: what its mappings span, touched or not."""
    return _statm_bytes(0)


def resident_bytes():
    """The bytes of its mappings held in memory now."""
    return _statm_bytes(1)
