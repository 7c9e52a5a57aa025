"""rlt-kv: logical paged KV-cache management with per-depth block tables (module M4)."""

from rlt_kv.block_pool import BlockPool
from rlt_kv.manager import KVCacheManager
from rlt_kv.prefix_cache import PrefixCache, cacheable_pages, page_keys

__all__ = [
    "BlockPool",
    "KVCacheManager",
    "PrefixCache",
    "cacheable_pages",
    "page_keys",
]
