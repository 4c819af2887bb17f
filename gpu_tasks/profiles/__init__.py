"""Resource profiles: what a task needs and where its workers run (``model``), the tag that sends a
task to one (``tags``), and which are in force (``in_force``).
"""

from gpu_tasks.profiles.in_force import (
    DEFAULT_PROFILE,
    load_profiles_file,
    profile_sources,
    profiles_from_mapping,
    resolve_profiles,
)
from gpu_tasks.profiles.model import (
    KIND_FIELDS,
    MAX_SHARE,
    TAG_PREFIX,
    CudaOptions,
    Kind,
    ResourceProfile,
    TlsOptions,
    is_valid_name,
)
from gpu_tasks.profiles.tags import profile, profile_from_tags, profile_tag, requested_profile, use_profile

__all__ = [
    "DEFAULT_PROFILE",
    "KIND_FIELDS",
    "MAX_SHARE",
    "TAG_PREFIX",
    "CudaOptions",
    "Kind",
    "ResourceProfile",
    "TlsOptions",
    "is_valid_name",
    "load_profiles_file",
    "profile",
    "profile_from_tags",
    "profile_sources",
    "profile_tag",
    "profiles_from_mapping",
    "requested_profile",
    "resolve_profiles",
    "use_profile",
]
