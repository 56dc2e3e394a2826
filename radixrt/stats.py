"""The scheduler's figures as one typed struct: what GetStats and FlushCache answer (in ControlReply),
what /metrics exports and get_server_info shows."""

from __future__ import annotations

import msgspec


class SchedulerStats(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The scheduler's figures, as GetStats and FlushCache answer them. Every field is required and
    no other is taken, so a figure renamed on one side fails where it is built instead of going
    missing from /metrics. server/metrics.py exports them by field name; get_server_info shows them
    all (info()); tests/test_stats_coverage.py holds every field to one of the two."""

    # the device KV pool (pages)
    num_pages: int
    free_pages: int
    cached_pages: int
    evictable_pages: int
    used_pages: int
    evicted_pages: int
    page_size: int
    kv_peak_used_pages: int
    # the lower tiers (0 without them)
    host_pages: int
    host_cached_pages: int
    host_swap_pages: int
    disk_pages: int
    disk_cached_pages: int
    disk_tier_enabled: int
    pages_d2h: int
    pages_h2d: int
    pages_h2disk: int
    pages_d2disk: int
    pages_disk2d: int
    pages_drop: int
    host_hit_pages: int
    disk_hit_pages: int
    disk_tier_errors: int
    tier_move_seconds: float
    unreachable_pages: int
    cascade_dropped_pages: int
    pinned_dropped_pages: int
    # pins (cache_control ttl)
    pinned_pages: int
    pin_budget_pages: int
    pinned_namespaces: int
    pins_taken: int
    pins_refused: int
    pinned_pages_expired: int
    # load or recompute a lower tier's pages (scheduler/tier_costs.py): the choices, and the estimates
    # behind them (0.0: not measured yet)
    tier_load_pages: int
    tier_recompute_pages: int
    cost_h2d_s_per_page: float
    cost_disk_s_per_page: float
    cost_prefill_s_per_token: float
    cost_attention_per_position: float
    cost_prefill_steps: int
    # memory (rank 0's; what `radixrt estimate` predicts)
    worker_rss_bytes: int
    worker_rss_peak_bytes: int
    device_memory_allocated_bytes: int
    device_memory_reserved_bytes: int
    device_memory_peak_bytes: int
    memory_limit_bytes: int
    host_tier_used_bytes: int
    host_tier_capacity_bytes: int
    disk_tier_used_bytes: int
    disk_tier_capacity_bytes: int
    bytes_per_token: int
    kv_pool_bytes: int
    page_table_bytes: int
    weight_bytes: int
    lora_pool_bytes: int  # the LoRA adapter slots' tensors on one rank (0: no --enable-lora)
    # the queues and the work done
    running: int
    waiting: int
    forward_steps: int
    prompt_tokens: int
    cached_prompt_tokens: int
    cache_hit_rate: float
    jump_forward_tokens: int
    requests_refused_no_memory: int
    # preemption
    retractions: int
    retractions_by_cause: dict[str, int]  # cause (scheduler/preemption.RETRACTION_CAUSES) -> retractions
    # production scheduling: queue limits, timeouts, the decodes' cadence (scheduler/queue_limits.py, step_budget.py)
    requests_rejected: dict[str, int]  # reason (queue_limits.REJECTIONS) -> requests answered with a 503
    prefill_cut_steps: int  # steps whose prefill was cut so the decodes keep their cadence
    # tenants (scheduler/tenants.py): label (a tenant's name, at most 16, then "other") -> figure
    tenant_requests: dict[str, int]
    tenant_prompt_tokens: dict[str, int]
    tenant_cached_tokens: dict[str, int]
    tenant_rejected: dict[str, int]
    tenant_waiting: dict[str, int]
    tenant_running: dict[str, int]
    tenant_cached_pages: dict[str, int]
    # LoRA (scheduler/lora_slots.py): label (an adapter's name, at most 16, then "other") -> figure
    lora_requests: dict[str, int]
    lora_prompt_tokens: dict[str, int]
    lora_cached_tokens: dict[str, int]
    lora_loads: int  # adapter loads into a worker slot (each start, each eviction's comeback)
    lora_adapters: int  # adapters registered now
    swaps_out: int
    swaps_in: int
    recomputed_tokens: int
    # weight updates
    weight_updates: int
    weight_update_pending: int
    held_for_weight_update: int
    # bounded-KV retention
    kv_retention_dropped_pages: int
    kv_retention_peak_pages: int
    kv_retention_retained_fraction: float
    kv_retention_requests: dict[str, int]  # policy -> requests admitted under it
    # speculative decoding (scheduler/speculation.py; zeros when it is off)
    spec_accept_length: float  # tokens a decode step gained per request, on average (SGLang's)
    spec_accept_rate: float  # drafts accepted / drafts verified
    spec_draft_tokens: int
    spec_accepted_tokens: int
    spec_verify_steps: int  # request decode steps on a speculating server
    spec_drafted_steps: int  # of them, those that verified drafts
    spec_tree_steps: int  # of those, the ones whose drafts branched (a tree, not a chain)
    spec_mean_draft_length: float  # drafts per drafted step: what the cost model chose
    spec_unspeculated_requests: dict[str, int]  # reason -> requests that ran unspeculated
    spec_ngram_index_entries: int
    spec_ngram_index_bytes: int
    spec_stale_draft_pages: int  # STANDALONE: device pages without their draft KV
    spec_step_seconds_fixed: float  # the cost model's fit: a decode step's seconds = fixed + per_token * plain work
    # + per_draft * drafted work (speculative/draft_length.py)
    spec_step_seconds_per_token: float  # a plain token's unit of work (1 + attention_per_position * positions)
    spec_step_seconds_per_draft: float  # a draft's
    # quality spot checks
    quality_spot_checks: int
    quality_spot_check_tokens: int
    quality_top1_agreement: float
    quality_mean_abs_dlogprob: float
    quality_last_top1_agreement: float
    quality_last_mean_abs_dlogprob: float
    quality_spot_checks_pending: int
    quality_spot_checks_skipped: int

    def info(self) -> dict[str, int | float]:
        """The fields as get_server_info shows them: flat, a dict field as one key per entry
        (retractions_<cause>, kv_retention_requests_<policy>)."""
        flat: dict[str, int | float] = {}
        for name, value in msgspec.structs.asdict(self).items():
            if isinstance(value, dict):
                prefix = "retractions_" if name == "retractions_by_cause" else name + "_"
                flat.update({prefix + key: n for key, n in value.items()})
            else:
                flat[name] = value
        return flat
