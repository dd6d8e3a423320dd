"""Global prefix-cache manager (§7): pure core modules.

* :mod:`.events`    -- cache events from workers (stored / removed / cleared / snapshot).
* :mod:`.trie`      -- :class:`PrefixTrie`: holders, per-degree statistics, match, Algorithm 1.
* :mod:`.scan`      -- Algorithm 2 and the §7.2 selection (:class:`ScanConfig`).
* :mod:`.reconcile` -- §6.2 reconciliation after split / merge, lazy reconcile copies.
* :mod:`.actions`   -- :class:`Replicate` / :class:`Reclaim` values the adapter dispatches.
"""
