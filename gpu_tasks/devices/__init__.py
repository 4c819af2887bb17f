"""Devices: discovery (NVML, a discovery script, emulation), per-host leases, and the device book
of one flow run. The public part is ``gpu_tasks.Device``, ``gpu_tasks.Inventory``, ``gpu_tasks.discover``."""
