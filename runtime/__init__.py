"""Runtime: engine loader, Executor, Scheduler, KVCacheManager, ModelRunner, sampling."""
