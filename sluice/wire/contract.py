"""The Redis contract between gateways and engines, written down once.

Every key and channel name either side uses comes from here. Payloads are the protobuf messages
of ``sluice.wire.messages_pb2`` (source: proto/sluice/wire/messages.proto).

Cluster safety is a property of these names. Every name carries a hash tag (the part in ``{}``),
and Redis Cluster places a key by its tag alone, so keys of one family share a hash slot and any
MULTI, multi-key command or ordered pipeline that stays inside one family works on a cluster as on
a single Redis. Nothing in Sluice touches keys of two families in one atomic operation. The four
below carry the requests; the Responses API's (``{resp:<response_id>}``, stored responses;
``{conv:<conversation_id>}``, conversations) and the tenants' are described with their keys further
down this module:

- ``{registry}``: the control plane (a few writes a second per process, never per token): the
  engine registry, liveness keys, model cards. One slot, so a card and the model set change in one
  MULTI.
- ``{e:<engine_id>}``: one engine's cancel channel: a cancel goes to the engine that holds the
  request (its owner marker names it), not to every engine.
- ``{q:<model>:<shard>}``: one shard of a model's queue (a model's queue is ``queue_shards``
  streams, ``sluice.wire.shards``; each shard has its own tag, so a cluster spreads a model's queue
  over its nodes). A shard's stream and the gateway's in-flight markers of its entries are in one
  slot, so XADD + marker is one atomic script and a failover loses both or neither (Redis
  replicates a node's writes in order): a marker that is gone still means "the entry is gone".
  The engine's hand-back (XADD, to the same shard) and XACK go together in one MULTI for the same
  reason. A shard holds one **lane** (stream) per tenant that queued there (``sluice.wire.tenants``):
  the shard's stream is the default tenant's lane (a deployment without tenants has no other), a
  tenant's lane is ``...:requests:<tenant>``, and the shard's lanes set names the tenants' lanes.
  All of them share the shard's tag, so the gateway's enqueue creates a lane (its consumer group,
  from the start, and its name in the set) in the same script as the marker and the XADD, and the
  engines' removal of an idle, empty lane (``LANE_REMOVE_SCRIPT``) is atomic with it. The engines
  read a shard's lanes in fair-share order (``engine_service.core.fair_share``): a tenant's flood
  waits in its own lane, not ahead of everyone else's requests.
- ``{g:<reply_to>}``: one gateway process's replies (``GenerateRequest.reply_to``). All events of
  its requests go through ONE sharded channel (SPUBLISH/SSUBSCRIBE: a cluster delivers it on the
  slot's node only, instead of broadcasting every token to every node), batched per engine step;
  the emitted, cancelled and owner markers of its requests live in the same slot, so the engine's
  "emitted" marker and the event it guards travel over one connection, in order, and the engine's
  take of an entry (TAKE_SCRIPT: cancelled? then "owner = me") and a gateway's cancel
  (CANCEL_SCRIPT: "cancelled", then who owns it?) are each one script of that slot: whichever runs
  first, the other sees it, so a cancel is either seen at the take or sent to the owner.
- ``{r:<rid>}``: one request's event log, its record and its lease (issue 22: resumable streams and
  background responses), keyed by the request id (an engine request id, which for a single-prompt
  request is the OpenAI id the client sees). One tag per request spreads logs over a cluster's
  nodes; the engine appends to the log in its per-step pipeline (the pipeline spans families, the
  log's own commands stay in its slot).

| key / channel                        | type                   | writer  | purpose                                   |
|--------------------------------------|------------------------|---------|-------------------------------------------|
| sluice:{q:<model>:<shard>}:requests  | stream, group engines  | gateway | one shard of the request queue (field "r": GenerateRequest); the gateway picks the shard from the prompt's first blocks; the default tenant's lane |
| sluice:{q:<model>:<shard>}:requests:<tenant> | stream, group engines | gateway | a tenant's lane of the shard (same entries); created with its group by ENQUEUE_SCRIPT, removed by the engines once empty and idle for LANE_IDLE_S (LANE_REMOVE_SCRIPT) |
| sluice:{q:<model>:<shard>}:lanes     | set of tenant ids      | gateway | the tenants that have a lane in the shard (engines ignore a member that is not a valid tenant id) |
| sluice:{q:<model>:<shard>}:inflight:<rid> | string with TTL   | gateway | set atomically with the request's XADD (ENQUEUE_SCRIPT), deleted when the gateway is done with it: gone while the gateway still waits = Redis lost the entry |
| sluice:{g:<reply_to>}:events         | sharded channel        | engine  | EventFrame messages for the requests of one reply_to |
| sluice:{g:<reply_to>}:emitted:<rid>  | string with TTL        | engine  | set with a request's first token: a reclaimed request that has it is errored, not restarted |
| sluice:{g:<reply_to>}:cancelled:<rid>| string with TTL        | gateway | a cancel remembered for a still-queued request |
| sluice:{g:<reply_to>}:owner:<rid>    | string with TTL        | engine  | the id of the engine that took the request (TAKE_SCRIPT), deleted when it lets it go |
| sluice:{e:<engine_id>}:cancel        | sharded channel        | gateway | Cancel messages for the requests that engine owns |
| sluice:{registry}:engines            | hash id -> EngineEntry | engine  | the registry (``sluice.wire.registry``): model, load, last heartbeat, the prompt tokens it took per queue shard and the shards it owns (``shards.balanced_owners``) |
| sluice:{registry}:engine:<engine_id> | string with TTL        | engine  | liveness: gone when the heartbeat lapses  |
| sluice:{registry}:room:<engine_id>   | string with TTL        | engine  | "1" while the engine's reader has credit (room for more work), "0" when it has none: written when that changes and with each heartbeat; a peer takes the queue shards of an owner without room at once |
| sluice:{registry}:gateway:<gateway_id>| string with TTL       | gateway | liveness of the gateway process named in GenerateRequest.gateway_id: gone for GATEWAY_LOST_AFTER_S = its requests are aborted |
| sluice:{registry}:model:<model>      | hash                   | engine  | model card (``sluice.wire.card``): tokenizer, chat template, limits |
| sluice:{registry}:models             | set                    | engine  | names of models that have a card          |
| sluice:{registry}:queue_shards:<model>| set of ints           | engine  | every shard count an engine of the model has published: engines serve the shards of the largest, so a rolling change of the count strands nothing |
| sluice:{registry}:served:<model>     | string with TTL        | engine  | refreshed by each heartbeat of the model's engines, TTL their model grace: gone = nobody has served the model for that long, and gateways remove its keys (MODEL_FORGET_SCRIPT, SHARD_FORGET_SCRIPT) |
| sluice:{r:<rid>}:log                 | list                   | engine  | the request's event log (GenerateRequest.log_events): one EventBatch per publish |
| sluice:{r:<rid>}:record              | string (JSON)          | gateway | what any gateway needs to render the log (``sluice.wire.event_log.StreamRecord``) |
| sluice:{r:<rid>}:lease               | string with TTL        | gateway | a gateway follows the log for a resumed client: the engine's lost-gateway rule spares the request |

A model name or reply id is used as it is inside the tag; Redis takes the tag up to the first
``}``, so a name containing ``}`` still maps all its keys to one slot (a shorter tag, the same for
each key of that name).
"""

from __future__ import annotations

from sluice.wire.messages_pb2 import ErrorCode

# Raised whenever the payloads or the rules change; a gateway and an engine of different versions
# refuse each other (card.check_version, the engine's check of GenerateRequest.version).
# 2: error codes and finish reasons as enums, terminal event as a oneof, the typed ModelCard.
# 3: hash-tagged names (Redis Cluster), GenerateRequest.reply_to, events batched per reply_to on a
#    sharded channel (EventBatch), the registry entry as a typed codec.
# 4: the queue is sharded (``{q:<model>:<shard>}``, shard chosen from the prompt's prefix; the card
#    carries the shard count, block size and prefix blocks; the registry the shard counts published);
#    the per-request event log (GenerateRequest.log_events, detached, log_ttl_s; the {r:<rid>} family).
# 5: tenants (GenerateRequest.tenant, tenant_weight; sluice.wire.tenants); a queue shard holds one
#    lane per tenant (``lane_stream``, ``lanes_key``: the default tenant's is the shard's stream).
# 6: a cancel goes to the engine that took the request (``owner_key``, TAKE_SCRIPT, CANCEL_SCRIPT,
#    ``cancel_channel``; no channel every engine hears); a reply channel carries an EventFrame whose
#    per-request parts are the bytes the request's log gets (log elements are unchanged); the
#    ``served`` key, and the removal of an unserved model's keys (MODEL_FORGET_SCRIPT, SHARD_FORGET_SCRIPT).
CONTRACT_VERSION = 6
PREFIX = "sluice"

CONSUMER_GROUP = "engines"
REQUEST_FIELD = b"r"  # the stream entry's field holding the GenerateRequest bytes

REGISTRY_TAG = "{registry}"
ENGINES_KEY = f"{PREFIX}:{REGISTRY_TAG}:engines"
MODELS_KEY = f"{PREFIX}:{REGISTRY_TAG}:models"

# Liveness: an engine refreshes its key every HEARTBEAT_INTERVAL_S; the key expires after
# HEARTBEAT_TTL_S, after which other engines may reclaim its pending entries.
HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TTL_S = 5.0
CANCEL_MARKER_TTL_S = 600

# Gateway liveness: a gateway refreshes its key every GATEWAY_HEARTBEAT_INTERVAL_S from its start; the
# key expires GATEWAY_HEARTBEAT_TTL_S after the last refresh. An engine aborts the
# requests of a gateway whose key it has found missing, check after check, for GATEWAY_LOST_AFTER_S:
# a single miss is not enough, because a Redis restart without its data removes every live
# gateway's key too, and a live gateway puts it back within a heartbeat of reconnecting.
GATEWAY_HEARTBEAT_INTERVAL_S = 1.0
GATEWAY_HEARTBEAT_TTL_S = 5.0
GATEWAY_LOST_AFTER_S = 5.0

# The model card's hash fields are defined with the card: sluice.wire.card.


# The queue's shards (sluice.wire.shards): the default count, published on the model card by the
# engines (``--queue-shards``); gateways take it from the card. 16: rendezvous hashing spreads 16
# shards over 2-4 engines within about a shard or two of even, and over a 3-master cluster's nodes;
# each extra shard costs one more XREADGROUP in an engine's pipelined read and one more probe.
DEFAULT_QUEUE_SHARDS = 16
MAX_QUEUE_SHARDS = 1024
# How many full KV blocks at the start of a prompt choose its shard (the card carries it).
DEFAULT_SHARD_PREFIX_BLOCKS = 8
# Bounded-load ownership (shards.balanced_owners): an engine's owned shards may carry this fraction
# more than its fair share of the queue's recent prompt tokens (--shard-load-slack); those loads
# are sums decayed with this half-life (long enough that ownership holds still, short enough that
# it follows a tenant mix that changes within a minute).
DEFAULT_SHARD_LOAD_SLACK = 0.1
SHARD_LOAD_HALF_LIFE_S = 20.0
# An engine with room takes another shard's entries once the oldest waited this long (--steal-after-ms).
DEFAULT_STEAL_AFTER_MS = 200


def queue_tag(model: str, shard: int) -> str:
    """The hash tag of one shard of a model's queue."""
    return "{q:" + model + ":" + str(int(shard)) + "}"


def reply_tag(reply_to: str) -> str:
    """The hash tag of one reply_to's family (a gateway process, or a WireClient handle)."""
    return "{g:" + reply_to + "}"


def request_stream(model: str, shard: int) -> str:
    return f"{PREFIX}:{queue_tag(model, shard)}:requests"


def request_streams(model: str, shards: int) -> list[str]:
    """The streams of shards 0 .. shards-1 of a model's queue."""
    return [request_stream(model, s) for s in range(max(1, int(shards)))]


def lane_stream(model: str, shard: int, tenant: str) -> str:
    """A tenant's lane of one shard: the shard's stream itself for the default tenant ("")."""
    stream = request_stream(model, shard)
    return f"{stream}:{tenant}" if tenant else stream


def lanes_key(model: str, shard: int) -> str:
    """The set of tenants that have a lane in the shard (the default tenant's is never in it)."""
    return f"{PREFIX}:{queue_tag(model, shard)}:lanes"


def inflight_key(model: str, shard: int, request_id: str) -> str:
    return f"{PREFIX}:{queue_tag(model, shard)}:inflight:{request_id}"


def queue_shards_key(model: str) -> str:
    return f"{PREFIX}:{REGISTRY_TAG}:queue_shards:{model}"


def served_key(model: str) -> str:
    return f"{PREFIX}:{REGISTRY_TAG}:served:{model}"


# --- a model nobody serves any more -------------------------------------------------------------
# Each heartbeat of an engine (and its card's publication) sets served_key(model) with the engine's
# model grace as TTL (``--model-grace-s``). Once it is gone -- no engine of the model for that long --
# gateways remove what the model left: every shard's empty streams (lanes included, the lanes set
# with them; entries nobody waits for deleted first: gateway/unserved.py), then the card, the
# shard counts and the model's name in the models set. An engine that starts again publishes them
# anew (its card and served key in one MULTI, so the forget script never removes a card that is
# served), and a stream removed under an engine's feet is recreated with its group (NOGROUP).
DEFAULT_MODEL_GRACE_S = 600

# One shard: remove each of the given streams (the shard's own, tenants' lanes) that holds no entry,
# and the lanes' names that went. Returns how many streams still hold entries.
# KEYS: lanes_key, then the streams; ARGV: the tenant of each stream ("" for the shard's own).
SHARD_FORGET_SCRIPT = """
local left = 0
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 and redis.call('XLEN', KEYS[i]) > 0 then
    left = left + 1
  else
    redis.call('DEL', KEYS[i])
    if ARGV[i - 1] ~= '' then redis.call('SREM', KEYS[1], ARGV[i - 1]) end
  end
end
if redis.call('SCARD', KEYS[1]) == 0 then redis.call('DEL', KEYS[1]) end
return left
"""

# The model's card, shard counts and name, unless an engine serves it again. Returns 1 when removed.
# KEYS: served_key, model_card_key, queue_shards_key, MODELS_KEY; ARGV: model.
MODEL_FORGET_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('DEL', KEYS[2], KEYS[3])
redis.call('SREM', KEYS[4], ARGV[1])
return 1
"""


def events_channel(reply_to: str) -> str:
    return f"{PREFIX}:{reply_tag(reply_to)}:events"


def emitted_key(reply_to: str, request_id: str) -> str:
    return f"{PREFIX}:{reply_tag(reply_to)}:emitted:{request_id}"


def cancelled_key(reply_to: str, request_id: str) -> str:
    return f"{PREFIX}:{reply_tag(reply_to)}:cancelled:{request_id}"


def owner_key(reply_to: str, request_id: str) -> str:
    """Who holds the request now: the id of the engine whose TAKE_SCRIPT took it."""
    return f"{PREFIX}:{reply_tag(reply_to)}:owner:{request_id}"


def engine_tag(engine_id: str) -> str:
    """The hash tag of one engine's family (its cancel channel)."""
    return "{e:" + engine_id + "}"


def cancel_channel(engine_id: str) -> str:
    """The sharded channel an engine hears the cancels of the requests it owns on."""
    return f"{PREFIX}:{engine_tag(engine_id)}:cancel"


# An engine takes the entries it read, one script each in the reply_to's slot: whether the request
# was cancelled while queued, whether an earlier attempt emitted tokens, and (unless cancelled) the
# owner marker naming this engine. A gateway's cancel (CANCEL_SCRIPT) runs in the same slot: run
# before the take, the take sees "cancelled"; run after, the cancel sees the owner and sends it the
# Cancel. The engine deletes the marker in the step that lets the request go (its XACK).
# KEYS: cancelled_key, emitted_key, owner_key; ARGV: engine id, marker TTL (s). Returns {cancelled, emitted}.
TAKE_SCRIPT = """
local cancelled = redis.call('EXISTS', KEYS[1])
local emitted = redis.call('EXISTS', KEYS[2])
if cancelled == 0 then
  redis.call('SET', KEYS[3], ARGV[1], 'EX', ARGV[2])
end
return {cancelled, emitted}
"""

# THE cancel of requests of one reply_to: each request's cancelled marker (an engine that takes it
# later drops it), then who owns it ('' while none does: queued, or over). The caller sends one
# Cancel to each owner's ``cancel_channel``.
# KEYS: cancelled_key, owner_key of each request in turn; ARGV: marker TTL (s). Returns the owners.
CANCEL_SCRIPT = """
local owners = {}
for i = 1, #KEYS, 2 do
  redis.call('SET', KEYS[i], '1', 'EX', ARGV[1])
  owners[#owners + 1] = redis.call('GET', KEYS[i + 1]) or ''
end
return owners
"""


def engine_key(engine_id: str) -> str:
    return f"{PREFIX}:{REGISTRY_TAG}:engine:{engine_id}"


def room_key(engine_id: str) -> str:
    return f"{PREFIX}:{REGISTRY_TAG}:room:{engine_id}"


def gateway_key(gateway_id: str) -> str:
    return f"{PREFIX}:{REGISTRY_TAG}:gateway:{gateway_id}"


def model_card_key(model: str) -> str:
    return f"{PREFIX}:{REGISTRY_TAG}:model:{model}"


# The gateway's enqueue, atomic on one server and on a cluster (every key in the queue's slot): the
# in-flight marker, then the entry; returns the entry id. A script rather than MULTI/EXEC because
# redis-py's asyncio cluster client cannot run a transaction (8.1 executes it on a thread of its
# own event loop); a script is one round trip on both topologies and replicated as one unit.
# A tenant's request goes to its lane: a lane that does not exist yet gets its consumer group from
# id 0 (no entry is ever skipped) and its name in the lanes set, in the same step. The default
# tenant's runs SET and XADD only, as before lanes.
# KEYS: lane_stream, inflight_key, lanes_key; ARGV: GenerateRequest bytes, marker TTL (s; 0: no
# marker, WireClient), REQUEST_FIELD, tenant ("" default), CONSUMER_GROUP.
ENQUEUE_SCRIPT = """
if tonumber(ARGV[2]) > 0 then
  redis.call('SET', KEYS[2], '1', 'EX', ARGV[2])
end
if ARGV[4] ~= '' then
  redis.call('SADD', KEYS[3], ARGV[4])
  if redis.call('EXISTS', KEYS[1]) == 0 then
    redis.call('XGROUP', 'CREATE', KEYS[1], ARGV[5], '0', 'MKSTREAM')
  end
end
return redis.call('XADD', KEYS[1], '*', ARGV[3], ARGV[1])
"""

# An engine removes a tenant's lane that holds nothing (no entry left after the trim, nothing
# pending) and took no entry for LANE_IDLE_S, with its name in the lanes set, in one step: an
# enqueue that follows creates it again. Returns 1 when removed (or already gone), else 0.
# KEYS: lane_stream, lanes_key; ARGV: tenant, now (ms since the epoch), LANE_IDLE_S in ms.
LANE_IDLE_S = 60
LANE_REMOVE_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  if redis.call('XLEN', KEYS[1]) > 0 then return 0 end
  local info = redis.call('XINFO', 'STREAM', KEYS[1])
  for i = 1, #info, 2 do
    if info[i] == 'last-generated-id' then
      local ms = tonumber(string.match(info[i + 1], '^(%d+)'))
      if ms and ms > tonumber(ARGV[2]) - tonumber(ARGV[3]) then return 0 end
    end
  end
  local groups = redis.call('XINFO', 'GROUPS', KEYS[1])
  for _, g in ipairs(groups) do
    for i = 1, #g, 2 do
      if g[i] == 'pending' and tonumber(g[i + 1]) > 0 then return 0 end
    end
  end
  redis.call('DEL', KEYS[1])
end
redis.call('SREM', KEYS[2], ARGV[1])
return 1
"""

# The in-flight marker outlives the request's deadline by this much (a crashed gateway's markers
# expire on their own). Engines never touch it.
INFLIGHT_MARGIN_S = 60


# The emitted marker outlives any request the engine would still run.
EMITTED_TTL_S = 3600
# A request delivered (read, reclaimed or handed back) more often than this is errored, not retried:
# a poison request must not take down every engine in turn.
MAX_ATTEMPTS = 3

# Error codes carried by Event.error.code: the proto enum's values (codec.error_code_name gives
# the short name, e.g. "deadline_exceeded").
ERR_INVALID_REQUEST = ErrorCode.ERROR_CODE_INVALID_REQUEST
ERR_CONTEXT_LENGTH = ErrorCode.ERROR_CODE_CONTEXT_LENGTH_EXCEEDED
ERR_KV_CACHE_TOO_SMALL = ErrorCode.ERROR_CODE_KV_CACHE_TOO_SMALL
ERR_DEADLINE = ErrorCode.ERROR_CODE_DEADLINE_EXCEEDED
ERR_ENGINE_LOST = ErrorCode.ERROR_CODE_ENGINE_LOST
ERR_DRAINING = ErrorCode.ERROR_CODE_DRAINING
ERR_INTERNAL = ErrorCode.ERROR_CODE_INTERNAL
ERR_CONTRACT_MISMATCH = ErrorCode.ERROR_CODE_CONTRACT_MISMATCH


# --- the per-request event log: resumable streams, background requests (the {r:<rid>} family) ---
# Written by the engine for a request with GenerateRequest.log_events (sluice.wire.event_log holds
# the codecs). Lifetimes: the gateway writes the record with TTL (time to the deadline) + the log
# TTL; the engine EXPIREs the log the same way at its first write, and log and record to the log
# TTL when the request ends, so both outlive any run and vanish a window after it.
DEFAULT_LOG_TTL_S = 600
# A gateway that follows a log for a resumed client holds the request's lease; it refreshes it every
# LEASE_REFRESH_S, and it lapses LEASE_TTL_S after the last refresh.
LEASE_TTL_S = 5.0
LEASE_REFRESH_S = 1.0
# How long a logged, not detached request whose client (or gateway) went away keeps running, waiting
# for a resume (a lease): the window of the lost-gateway rule (key TTL + the engine's wait).
RESUME_WINDOW_S = GATEWAY_HEARTBEAT_TTL_S + GATEWAY_LOST_AFTER_S


def request_tag(request_id: str) -> str:
    """The hash tag of one request's event-log family."""
    return "{r:" + request_id + "}"


def log_key(request_id: str) -> str:
    return f"{PREFIX}:{request_tag(request_id)}:log"


def record_key(request_id: str) -> str:
    return f"{PREFIX}:{request_tag(request_id)}:record"


def lease_key(request_id: str) -> str:
    return f"{PREFIX}:{request_tag(request_id)}:lease"


# --- stored responses (the Responses API) ------------------------------------------------------
# One family per response: ``{resp:<response_id>}``. The response is one hash
# (``sluice.wire.stored_response``: its record, its input items, the final object, the ids of its
# nearest ancestors in a ``previous_response_id`` chain), written with its TTL in one script
# (RESPONSE_SAVE_SCRIPT), so a response is always stored whole or not at all and expires as one. A
# chain is read by walking the links (pipelined reads, one family each: no multi-key command), which
# renew each response's TTL as they go, so a conversation in use never loses its start.
# A stored response's events are not kept here: the engine writes them to its request's log
# (the ``{r:<rid>}`` family above), which the stored record names.
#
# | key                              | type            | writer  | purpose                              |
# |----------------------------------|-----------------|---------|--------------------------------------|
# | sluice:{resp:<response_id>}      | hash with TTL   | gateway | a stored response (fields: stored_response.F_*) |


def response_tag(response_id: str) -> str:
    """The hash tag of one stored response's family."""
    return "{resp:" + response_id + "}"


def response_key(response_id: str) -> str:
    return f"{PREFIX}:{response_tag(response_id)}"


# Write fields of a stored response and (re)set its TTL in one step. ARGV[2] "create" writes
# unconditionally; "update" writes only while the hash exists (a response deleted, or expired,
# while it ran is not brought back). Returns 1 when written, 0 when not.
# KEYS: response_key; ARGV: TTL (ms), mode, then field, value pairs.
RESPONSE_SAVE_SCRIPT = """
if ARGV[2] == 'update' and redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
"""

# Delete a stored response if it is the tenant's (its ``tenant`` field; absent: the default
# tenant's, whose id is empty). Returns 1 when deleted, 0 when there is none of this tenant's.
# KEYS: response_key; ARGV: tenant.
RESPONSE_DELETE_SCRIPT = """
local owner = redis.call('HGET', KEYS[1], 'tenant') or ''
if redis.call('EXISTS', KEYS[1]) == 0 or owner ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
return 1
"""


# --- conversations (the Conversations API) -------------------------------------------------------
# One family per conversation, ``{conv:<conversation_id>}``: its object, its items by id and their
# order, so every operation is one script over one slot (atomic on a cluster too) that checks the
# caller's tenant first (another tenant's conversation is, to every script, one that does not exist)
# and sets the three keys' TTL together.
#
# | key                                   | type            | writer  | purpose                              |
# |---------------------------------------|-----------------|---------|--------------------------------------|
# | sluice:{conv:<id>}                    | hash with TTL   | gateway | tenant, created_at, metadata (JSON), next (the last item's number) |
# | sluice:{conv:<id>}:items              | hash with TTL   | gateway | item id -> item (JSON)               |
# | sluice:{conv:<id>}:order              | zset with TTL   | gateway | item id -> its number (the order items were added in) |


def conversation_tag(conversation_id: str) -> str:
    """The hash tag of one conversation's family."""
    return "{conv:" + conversation_id + "}"


def conversation_keys(conversation_id: str) -> list[str]:
    """The conversation's object, items and order keys: every conversation script's KEYS."""
    base = f"{PREFIX}:{conversation_tag(conversation_id)}"
    return [base, f"{base}:items", f"{base}:order"]


# Shared by the scripts below: owned(tenant), KEYS[1] (the conversation) exists and is the tenant's;
# touch(ttl), the three keys' TTL; append(from), the item id, item JSON pairs of ARGV from ``from`` on
# (an id the conversation has already is left as it is), returning how many were added.
_CONVERSATION_OWNED = """
local function owned(tenant)
  local owner = redis.call('HGET', KEYS[1], 'tenant')
  return owner and owner == tenant
end
local function touch(ttl)
  for k = 1, 3 do redis.call('PEXPIRE', KEYS[k], ttl) end
end
local function append(from)
  local added = 0
  for i = from, #ARGV, 2 do
    if redis.call('HEXISTS', KEYS[2], ARGV[i]) == 0 then
      local n = redis.call('HINCRBY', KEYS[1], 'next', 1)
      redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
      redis.call('ZADD', KEYS[3], n, ARGV[i])
      added = added + 1
    end
  end
  return added
end
"""

# Create a conversation with its first items. ARGV: TTL (ms), tenant, created_at, metadata (JSON),
# then item id, item JSON pairs. Returns 1 (0: the id exists already).
CONVERSATION_CREATE_SCRIPT = _CONVERSATION_OWNED + """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'tenant', ARGV[2], 'created_at', ARGV[3], 'metadata', ARGV[4], 'next', 0)
append(5)
touch(ARGV[1])
return 1
"""

# Add items at the end. ARGV: TTL (ms), tenant, mode, then item id, item JSON pairs. Mode 'strict'
# (the API's add): an id already in the conversation adds nothing and returns {-2, that id}; mode
# 'skip' (a response's turn, which two gateways may both append): those ids are left as they are.
# Returns {-1} when the conversation is not the tenant's, else {1, number added}.
CONVERSATION_ADD_SCRIPT = _CONVERSATION_OWNED + """
if not owned(ARGV[2]) then return {-1} end
if ARGV[3] == 'strict' then
  for i = 4, #ARGV, 2 do
    if redis.call('HEXISTS', KEYS[2], ARGV[i]) == 1 then return {-2, ARGV[i]} end
  end
end
local added = append(4)
touch(ARGV[1])
return {1, added}
"""

# Read the conversation's object (and renew its TTL when ARGV[3] is "1"). ARGV: TTL (ms), tenant,
# renew. Returns {-1} when not the tenant's, else {1, created_at, metadata}.
CONVERSATION_GET_SCRIPT = _CONVERSATION_OWNED + """
if not owned(ARGV[2]) then return {-1} end
if ARGV[3] == '1' then touch(ARGV[1]) end
return {1, redis.call('HGET', KEYS[1], 'created_at'), redis.call('HGET', KEYS[1], 'metadata')}
"""

# Set the metadata. ARGV: TTL (ms), tenant, metadata (JSON). Returns as CONVERSATION_GET_SCRIPT.
CONVERSATION_UPDATE_SCRIPT = _CONVERSATION_OWNED + """
if not owned(ARGV[2]) then return {-1} end
redis.call('HSET', KEYS[1], 'metadata', ARGV[3])
touch(ARGV[1])
return {1, redis.call('HGET', KEYS[1], 'created_at'), ARGV[3]}
"""

# Delete the conversation and its items. ARGV: tenant. Returns 1, or 0 when there is none of its.
CONVERSATION_DELETE_SCRIPT = _CONVERSATION_OWNED + """
if not owned(ARGV[1]) then return 0 end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
return 1
"""

# One item. ARGV: tenant, item id. Returns {-1} (conversation), {-2} (item), or {1, item JSON}.
CONVERSATION_ITEM_SCRIPT = _CONVERSATION_OWNED + """
if not owned(ARGV[1]) then return {-1} end
local item = redis.call('HGET', KEYS[2], ARGV[2])
if not item then return {-2} end
return {1, item}
"""

# Delete one item. ARGV: TTL (ms), tenant, item id. Returns {-1}, {-2} or {1, created_at, metadata}.
CONVERSATION_ITEM_DELETE_SCRIPT = _CONVERSATION_OWNED + """
if not owned(ARGV[2]) then return {-1} end
if redis.call('HDEL', KEYS[2], ARGV[3]) == 0 then return {-2} end
redis.call('ZREM', KEYS[3], ARGV[3])
touch(ARGV[1])
return {1, redis.call('HGET', KEYS[1], 'created_at'), redis.call('HGET', KEYS[1], 'metadata')}
"""

# A page of items. ARGV: tenant, order ('asc' | 'desc'), after (an item id; '' for the first page),
# limit. Returns {-1}, {-2} (no item `after`), or {1, has_more (0 | 1), item JSON...}.
CONVERSATION_PAGE_SCRIPT = _CONVERSATION_OWNED + """
if not owned(ARGV[1]) then return {-1} end
local asc = ARGV[2] == 'asc'
local start = 0
if ARGV[3] ~= '' then
  local rank
  if asc then rank = redis.call('ZRANK', KEYS[3], ARGV[3]) else rank = redis.call('ZREVRANK', KEYS[3], ARGV[3]) end
  if not rank then return {-2} end
  start = rank + 1
end
local limit = tonumber(ARGV[4])
local ids
if asc then ids = redis.call('ZRANGE', KEYS[3], start, start + limit)
else ids = redis.call('ZREVRANGE', KEYS[3], start, start + limit) end
local out = {1, 0}
if #ids > limit then out[2] = 1; ids[#ids] = nil end
if #ids > 0 then
  for _, v in ipairs(redis.call('HMGET', KEYS[2], unpack(ids))) do out[#out + 1] = v end
end
return out
"""

# The newest items, for a response's prompt (newest first), renewing the TTL. ARGV: TTL (ms),
# tenant, most (the bound). Returns {-1}, or {1, cut (1: older items are left out), item JSON...}.
CONVERSATION_TAIL_SCRIPT = _CONVERSATION_OWNED + """
if not owned(ARGV[2]) then return {-1} end
local most = tonumber(ARGV[3])
local ids = redis.call('ZREVRANGE', KEYS[3], 0, most)
local out = {1, 0}
if #ids > most then out[2] = 1; ids[#ids] = nil end
for i = 1, #ids, 512 do  -- HMGET in slices: Lua's unpack takes some 8000 values at most
  local slice = {}
  for j = i, math.min(i + 511, #ids) do slice[#slice + 1] = ids[j] end
  for _, v in ipairs(redis.call('HMGET', KEYS[2], unpack(slice))) do out[#out + 1] = v end
end
touch(ARGV[1])
return out
"""


# --- tenants: API keys, quotas, usage -------------------------------------------------------------
# Three more families (sluice.wire.keys, sluice.wire.quota, sluice.wire.usage):
#
# - ``{keys}``: the API keys ``sluice keys`` manages: one hash (key hash -> KeyRecord JSON) and a
#   version counter that every write raises in the same script, so gateways reload only on change.
# - ``{t:<tenant>}``: one tenant's quota counters and usage. Every quota check and every correction
#   is ONE script over these keys (one slot: atomic on a cluster too), so gateways share the counters
#   and no burst overshoots a limit.
# - ``{mq:<model>}``: the admission gate of ``--max-queue-len``: requests admitted for the model and
#   not yet started, taken and released by script, so a burst cannot overshoot it either.
#
# | key                                  | type            | writer       | purpose                              |
# |--------------------------------------|-----------------|--------------|--------------------------------------|
# | sluice:{keys}:table                  | hash            | sluice keys  | key hash -> KeyRecord (JSON)         |
# | sluice:{keys}:version                | string (int)    | sluice keys  | raised by every write of the table   |
# | sluice:{t:<tenant>}:rpm              | hash with TTL   | gateway      | requests-per-minute bucket (level, at) |
# | sluice:{t:<tenant>}:tpm              | hash with TTL   | gateway      | tokens-per-minute bucket (level, at) |
# | sluice:{t:<tenant>}:active           | zset with TTL   | gateway      | requests admitted, not ended (member -> expiry ms) |
# | sluice:{t:<tenant>}:queued           | zset with TTL   | gateway      | requests admitted, not started (member -> expiry ms) |
# | sluice:{t:<tenant>}:usage:<hour>     | hash with TTL   | engine       | tokens and requests per model in one UTC hour (sluice.wire.usage) |
# | sluice:{registry}:usage_tenants      | set             | engine       | tenants with usage, for `sluice usage` |
# | sluice:{mq:<model>}:queued           | zset with TTL   | gateway      | requests of the model admitted, not started (--max-queue-len) |

KEYS_TAG = "{keys}"
KEYS_TABLE = f"{PREFIX}:{KEYS_TAG}:table"
KEYS_VERSION = f"{PREFIX}:{KEYS_TAG}:version"
USAGE_TENANTS_KEY = f"{PREFIX}:{REGISTRY_TAG}:usage_tenants"


def tenant_tag(tenant: str) -> str:
    """The hash tag of one tenant's family (the default tenant's id is empty: ``{t:}``)."""
    return "{t:" + tenant + "}"


def rpm_key(tenant: str) -> str:
    return f"{PREFIX}:{tenant_tag(tenant)}:rpm"


def tpm_key(tenant: str) -> str:
    return f"{PREFIX}:{tenant_tag(tenant)}:tpm"


def active_key(tenant: str) -> str:
    return f"{PREFIX}:{tenant_tag(tenant)}:active"


def tenant_queued_key(tenant: str) -> str:
    return f"{PREFIX}:{tenant_tag(tenant)}:queued"


def usage_key(tenant: str, hour: str) -> str:
    """``hour``: UTC, ``YYYYMMDDHH`` (``sluice.wire.usage.hour_of``)."""
    return f"{PREFIX}:{tenant_tag(tenant)}:usage:{hour}"


def model_queued_key(model: str) -> str:
    return f"{PREFIX}:{{mq:{model}}}:queued"
