"""The swap-in contract (docs/contract.md) in plain Python, one request at a time.

Deliberately naive (lists, no vectorisation) so it reads as the contract itself; tests hold
both the jnp reference and the Pallas kernel to it.
"""


def swap_in_one_request(buffer_tokens, lru_slots, topk, n, host_slot_of):
    """Returns (slots, new_buffer_tokens, new_lru, hits, misses, plan[(host_slot, device_slot)])."""
    B = len(buffer_tokens)
    newest = n - 1
    distinct = []
    for p in topk:
        if p >= 0 and p != newest and p not in distinct:
            distinct.append(p)
    newest_selected = int(any(p == newest and p >= 0 for p in topk))
    if n <= B:  # fast path: slot j holds token j
        return list(topk), list(buffer_tokens), list(lru_slots), len(distinct) + newest_selected, 0, []

    tokens = list(buffer_tokens)
    hit_slots = {tokens.index(p) for p in distinct if p in tokens}
    misses = [p for p in distinct if p not in tokens]
    candidates = [s for s in lru_slots if s not in hit_slots]  # LRU first
    victims = candidates[: len(misses)]
    plan = []
    for p, slot in zip(misses, victims):
        tokens[slot] = p
        plan.append((host_slot_of(p), slot))
    untouched = candidates[len(misses):]
    hits_in_old_order = [s for s in lru_slots if s in hit_slots]
    new_lru = untouched + victims + hits_in_old_order
    slots = [-1 if p < 0 else B if p == newest else tokens.index(p) for p in topk]
    return slots, tokens, new_lru, len(distinct) - len(misses) + newest_selected, len(misses), plan


def speculative_plan_one_request(buffer_tokens, lru_slots, topk, committed, host_slot_of):
    """One plan of a speculative step (docs/contract.md, "Speculative steps"): the step's own
    positions (>= committed) resolve to their speculative slots B + 1 + (p - committed), counted
    as hits once each; the committed ones are planned as by swap_in_one_request for a context of
    committed + 1 tokens whose newest, position `committed`, nobody selected (so nothing resolves
    to the reserved slot B). Returns what swap_in_one_request returns."""
    B = len(buffer_tokens)
    old = [p if 0 <= p < committed else -1 for p in topk]
    slots, tokens, lru, hits, misses, plan = swap_in_one_request(buffer_tokens, lru_slots, old, committed + 1, host_slot_of)
    own = []
    for p in topk:
        if p >= committed and p not in own:
            own.append(p)
    slots = [B + 1 + p - committed if p >= committed else s for p, s in zip(topk, slots)]
    return slots, tokens, lru, hits + len(own), misses, plan
