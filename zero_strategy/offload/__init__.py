"""Disk (nvme) offload: the per-rank files, read ahead and written behind (disk_offload)."""
