"""Where a generation's rendezvous keys live on the coordinator's store (torch-free: both the
workers' c10d store, runtime/data_plane.py, and the coordinator's checks use it)."""


def generation_prefix(generation: int) -> str:
    return f"gen{generation}/"
