"""Devices: discovery (NVML, a discovery script, emulation), per-host leases, and the device book
of one flow run. ``from gpu_tasks.devices import Device, Inventory, discover`` is the public part."""

from gpu_tasks.devices.discovery import Device, Inventory, discover

__all__ = ["Device", "Inventory", "discover"]
