/* The full memory fence the shm seqlock needs on CPUs that reorder memory accesses (services/connectors/shm_fence.py).
 * A call is also a compiler barrier: nothing moves across it. */
void epd_shm_fence(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
