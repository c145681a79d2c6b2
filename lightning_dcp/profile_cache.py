"""Deprecated alias of :mod:`lightning_dcp.profiling.cache` (moved in 0.2; removed in a later release)."""

import warnings

from lightning_dcp.profiling.cache import (CACHE_ENV, CORRUPT, FOREIGN, HIT, MISS, CacheLookup, ProfileCacheWarning,
                                           ProfileKey, default_cache_dir, device_name, load_cached, model_signature,
                                           profile_path, resolve_cache_dir, store)

warnings.warn("lightning_dcp.profile_cache is deprecated: import from lightning_dcp.profiling.cache",
              DeprecationWarning, stacklevel=2)

__all__ = ["CACHE_ENV", "CORRUPT", "FOREIGN", "HIT", "MISS", "CacheLookup", "ProfileCacheWarning", "ProfileKey",
           "default_cache_dir", "device_name", "load_cached", "model_signature", "profile_path", "resolve_cache_dir",
           "store"]
