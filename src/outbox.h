/*-------------------------------------------------------------------------
 *
 * outbox.h
 *	  Declarations shared by the files of the outbox extension.
 *
 * The extension has three parts that meet here:
 *	- the SQL API (emit.c) that writes events in the caller's transaction
 *	  and wakes the relay at commit,
 *	- the relay worker (worker.c, batch.c, producer.c) that publishes
 *	  committed events to Kafka,
 *	- the shared-memory status (shmem.c, status.c) through which the two
 *	  sides and the DBA see each other.
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_H
#define OUTBOX_H

#include "postgres.h"

#include "compat.h"

#include "datatype/timestamp.h"
#include "miscadmin.h"
#include "nodes/pg_list.h"
#include "storage/ipc.h"
#include "storage/latch.h"
#include "storage/spin.h"
#include "utils/guc.h"
#include "utils/jsonb.h"
#include "utils/uuid.h"

/* Schema and table; the install script creates them, the worker reads them */
#define OUTBOX_SCHEMA			"outbox"
#define OUTBOX_EVENTS_TABLE		"events"
#define OUTBOX_EXTENSION_NAME	"outbox"

/* Kafka's limit on topic names (see Kafka's Topic.validate) */
#define OUTBOX_TOPIC_MAX_LEN	249

/*
 * Longest aggregate_type and aggregate_id (bytes).  Both go into the btree
 * index the relay uses to find failed events of an aggregate, whose entries
 * cannot exceed about 2.7 kB; the aggregate id is also the Kafka key.
 */
#define OUTBOX_AGGREGATE_TYPE_MAX_BYTES	255
#define OUTBOX_AGGREGATE_ID_MAX_BYTES	1024

/* Headers every message carries before the user's own (reserved names) */
#define OUTBOX_HEADER_ID				"id"
#define OUTBOX_HEADER_EVENT_TYPE		"event_type"
#define OUTBOX_HEADER_AGGREGATE_TYPE	"aggregate_type"
/* ... and in the CloudEvents format; ce_id must stay the event id */
#define OUTBOX_HEADER_CE_ID				"ce_id"
#define OUTBOX_HEADER_CE_SPECVERSION	"ce_specversion"

/* Size of the error text kept in shared memory, including the terminator */
#define OUTBOX_ERROR_LEN		256

/*
 * guc.c: the outbox.* settings.  Values are in the units named; the GUC
 * machinery converts what the user wrote in postgresql.conf.
 */
extern char *outbox_database;			/* 1.x: the one database relayed */
extern char *outbox_databases;			/* '' = outbox.database; names; '*' */
extern int	outbox_max_workers;			/* relay slots in the whole server */
extern int	outbox_workers_per_database;	/* relays sharing a database */
extern char *outbox_bootstrap_servers;	/* host:port,...; empty = idle */
extern char *outbox_topic_prefix;		/* routed topic = prefix||aggregate_type */
extern int	outbox_batch_size;			/* events per claim */
extern int	outbox_poll_interval;		/* ms between polls without wake-ups */
extern char *outbox_kafka_properties;	/* extra librdkafka key=value;... */
extern int	outbox_retention;			/* s to keep published rows; -1 forever */
extern int	outbox_vacuum_interval;		/* s between the relay's VACUUMs; 0 = off */
extern int	outbox_delivery_timeout;	/* ms: message.timeout.ms */
extern int	outbox_retry_backoff_max;	/* ms: cap of the per-event backoff */
extern int	outbox_max_attempts;		/* permanent failures before "failed" */
extern int	outbox_on_failed_event;		/* OUTBOX_ON_FAILED_* */
extern int	outbox_relay_mode;			/* OUTBOX_RELAY_* */
extern int	outbox_delivery;			/* OUTBOX_DELIVERY_* */
extern char *outbox_progress_topic;	/* exactly_once: the progress topic */
extern char *outbox_allowed_topics;	/* topics emit() accepts; '' = all */
extern char *outbox_role;				/* role the relay runs as; '' = superuser */
extern const char *outbox_allowed_topic_list;	/* outbox.allowed_topics, parsed */
extern int	outbox_message_format;		/* OUTBOX_FORMAT_* */
extern char *outbox_ce_source;			/* CloudEvents source; '' = derived */
extern char *outbox_traceparent;		/* W3C traceparent; '' = none */
extern char *outbox_tracestate;			/* W3C tracestate; '' = none */

/* outbox.on_failed_event: later events of a failed event's aggregate ... */
#define OUTBOX_ON_FAILED_HOLD	0	/* ... wait behind it */
#define OUTBOX_ON_FAILED_SKIP	1	/* ... go on without it */

/* outbox.relay_mode: how emit() marks new events for the relay */
#define OUTBOX_RELAY_ROW		0	/* per-row state (published_at) */
#define OUTBOX_RELAY_SNAPSHOT	1	/* writing transaction (xid), see snapshot.c */

/* outbox.delivery: what a crash may cost consumers */
#define OUTBOX_DELIVERY_AT_LEAST_ONCE	0	/* idempotent producer; resends */
#define OUTBOX_DELIVERY_EXACTLY_ONCE	1	/* Kafka transactions, exactly_once.c */

/*
 * Key buckets (partition.c).  An event's bucket is a hash of its aggregate
 * (type and id), so it is fixed by the event row itself; worker j of the k
 * relays of a database serves buckets [j * 256 / k, (j + 1) * 256 / k).
 * Every event of an aggregate is served by one worker, whatever k is.
 */
#define OUTBOX_BUCKETS					256
#define OUTBOX_MAX_WORKERS_PER_DATABASE	32

extern bool outbox_rows_for_new_events(void);
extern int	outbox_relay_worker;		/* this relay's index j, 0-based */
extern int	outbox_relay_nworkers;		/* k of its database; 1 outside relays */
extern int	outbox_bucket_first(int worker, int nworkers);
extern bool outbox_relay_serves_all(void);

/* outbox.message_format: the shape of a message */
#define OUTBOX_FORMAT_DEBEZIUM		0	/* JSON value, id/event_type headers */
#define OUTBOX_FORMAT_CLOUDEVENTS	1	/* CloudEvents binary mode, ce_* */

extern void outbox_define_gucs(void);
extern bool outbox_check_bootstrap_servers(char **newval, void **extra,
										   GucSource source);

/*
 * guc_refusal.c: settings refused when the server started (the relay
 * publishes nothing while one stands)
 */
typedef enum OutboxRefusable
{
	OUTBOX_REFUSABLE_KAFKA_PROPERTIES,
	OUTBOX_REFUSABLE_MESSAGE_FORMAT,
	OUTBOX_REFUSABLE_CE_SOURCE,
	/* the inbox's (src/inbox): they stop the inbox, not the relay */
	OUTBOX_REFUSABLE_INBOX_KAFKA_PROPERTIES,
	OUTBOX_NUM_REFUSABLE
} OutboxRefusable;

/* the refusals that stop the relay come before the inbox's */
#define OUTBOX_NUM_RELAY_REFUSABLE	OUTBOX_REFUSABLE_INBOX_KAFKA_PROPERTIES

extern void outbox_note_refusal(OutboxRefusable setting, GucSource source,
								const char *why);
extern void outbox_clear_refusal(OutboxRefusable setting);
extern char *outbox_config_refusal(void);
extern char *outbox_refusal_of(OutboxRefusable setting);
extern void outbox_reload_config_file(void);

/*
 * dblist.c: which databases get a relay (outbox.databases)
 */
extern bool outbox_check_database(char **newval, void **extra,
								  GucSource source);
extern bool outbox_check_databases(char **newval, void **extra,
								   GucSource source);
extern List *outbox_relayed_databases(bool *all);
extern bool outbox_database_relayed(const char *name);

/* does a relay publish this database's outbox? (dblist.c) */
typedef enum OutboxRelayCoverage
{
	OUTBOX_RELAYED,
	OUTBOX_NOT_PRELOADED,		/* no relay runs: not in shared_preload_libraries */
	OUTBOX_OTHER_DATABASE,		/* not covered by outbox.databases (or .database) */
	OUTBOX_UNSERVABLE_DATABASE	/* covered, but a template or closed to
								 * connections: no relay can connect */
} OutboxRelayCoverage;

extern OutboxRelayCoverage outbox_relay_coverage(char **dbname);

/*
 * shmem.c: state shared between the relay worker and every backend.
 */
typedef enum OutboxRelayState
{
	OUTBOX_STATE_STARTING = 0,
	OUTBOX_STATE_WAITING_FOR_DATABASE,
	OUTBOX_STATE_WAITING_FOR_EXTENSION,
	OUTBOX_STATE_NOT_CONFIGURED,
	OUTBOX_STATE_CONFIG_ERROR,
	OUTBOX_STATE_IDLE,
	OUTBOX_STATE_PUBLISHING,
	OUTBOX_STATE_BROKER_DOWN,
	OUTBOX_STATE_PAUSED,
	OUTBOX_STATE_ERROR
} OutboxRelayState;

/*
 * One relay's shared state, in a slot the launcher assigns (launcher.c).
 * The relay fills in its pid, latch, state and counters; backends of its
 * database set its latch at commit; outbox.status reads it.  While the
 * relay's database cannot be connected to yet, the launcher itself holds
 * the slot (worker_pid = the launcher's pid, state waiting_for_database).
 */
typedef struct OutboxRelaySlot
{
	slock_t		mutex;			/* protects everything below */

	/* set by the launcher */
	bool		in_use;			/* assigned to a database */
	bool		inbox;			/* an inbox worker's (src/inbox), not a relay's */
	Oid			database_oid;	/* database served; InvalidOid if unknown */
	char		database_name[NAMEDATALEN];

	/* set by the relay worker: 0 if none runs */
	pid_t		worker_pid;
	Latch	   *worker_latch;	/* set at commit by emitting backends */
	uint32		control_seq;	/* bumped at commit of pause(), resume() etc. */
	TimestampTz started_at;
	bool		extension_absent;	/* set before a relay exits for lack of it */
	bool		connected;		/* the relay started here got connected (and
								 * registered); the launcher clears it */
	bool		has_extension;	/* the relay found outbox.events; the
								 * launcher clears it */
	bool		retire;			/* set by the launcher: exit between batches */
	int			worker;			/* index j of the relay in its database */
	int			nworkers;		/* k: relays sharing the database */

	OutboxRelayState state;
	int64		published;		/* events acknowledged since start */
	int64		failed;			/* events marked failed since start */
	int64		delivery_errors;	/* failed delivery attempts since start */
	TimestampTz last_publish_at;
	TimestampTz last_error_at;
	char		last_error[OUTBOX_ERROR_LEN];
} OutboxRelaySlot;

/*
 * A covered database the launcher could not start a relay for (shown by
 * outbox.cluster_status() and that database's outbox.status as
 * waiting_for_slot, or waiting_for_database if it cannot be connected to
 * either).  Only the first OUTBOX_MAX_UNSERVED are kept; the
 * launcher's WARNING names them all.
 */
#define OUTBOX_MAX_UNSERVED		256

typedef struct OutboxUnserved
{
	Oid			dboid;
	char		name[NAMEDATALEN];
	bool		no_bgworker;	/* max_worker_processes, not outbox.max_workers */
	TimestampTz since;			/* first pass that could not start it */
	/* a listed database that cannot be connected to, with no slot to show it */
	bool		waiting_for_database;
	char		obstacle[128];	/* why it cannot be connected to */
} OutboxUnserved;

/* databases whose relays a running DROP/RENAME DATABASE has released */
#define OUTBOX_MAX_BLOCKS		8
/* databases with a committed CREATE EXTENSION outbox not yet seen */
#define OUTBOX_MAX_EVENTS		16

typedef struct OutboxShared
{
	slock_t		mutex;			/* protects the fields up to slots */

	pid_t		launcher_pid;	/* 0 if the launcher does not run */
	Latch	   *launcher_latch;
	TimestampTz launcher_started_at;

	/* covered databases without a relay, as of the launcher's last pass */
	int			nunserved;
	OutboxUnserved unserved[OUTBOX_MAX_UNSERVED];

	/* CREATE EXTENSION outbox committed in these databases (lifecycle.c) */
	int			nevents;
	bool		events_overflow;	/* more than fit: re-probe every database */
	Oid			events[OUTBOX_MAX_EVENTS];

	/* databases no relay may serve while the backend blocked_by runs DDL */
	Oid			blocked_db[OUTBOX_MAX_BLOCKS];
	pid_t		blocked_by[OUTBOX_MAX_BLOCKS];
	TimestampTz blocked_until[OUTBOX_MAX_BLOCKS];

	int			nslots;			/* outbox.max_workers */
	OutboxRelaySlot slots[FLEXIBLE_ARRAY_MEMBER];
} OutboxShared;

extern OutboxShared *outbox_shared;

/*
 * What the relay waits for, shown as pg_stat_activity.wait_event on
 * PostgreSQL 17 and later (see outbox_wait_event).
 */
typedef enum OutboxWait
{
	OUTBOX_WAIT_IDLE = 0,		/* OutboxIdle: nothing to send, until a commit */
	OUTBOX_WAIT_DATABASE,		/* OutboxWaitForDatabase */
	OUTBOX_WAIT_PAUSED,			/* OutboxPaused: outbox.pause() */
	OUTBOX_WAIT_ERROR_BACKOFF,	/* OutboxErrorBackoff: after an ERROR */
	OUTBOX_WAIT_QUEUE_FULL,		/* OutboxProducerQueueFull */
	OUTBOX_WAIT_DELIVERY,		/* OutboxDeliveryReports: Kafka's acks */
	OUTBOX_WAIT_COUNT
} OutboxWait;

extern uint32 outbox_wait_event(OutboxWait wait);

/* shared-memory hooks, installed by _PG_init in the postmaster only */
extern shmem_request_hook_type outbox_prev_shmem_request_hook;
extern shmem_startup_hook_type outbox_prev_shmem_startup_hook;
extern void outbox_shmem_request(void);
extern void outbox_shmem_startup(void);
extern OutboxRelaySlot *outbox_my_slot;	/* the relay's own slot */
extern void outbox_shared_register_worker(int slot, int worker, int nworkers);
extern void outbox_shared_note_extension(void);
extern bool outbox_shared_retiring(void);
extern void outbox_shared_wait_for_others(void);
extern void outbox_wake_worker(bool control);
extern uint32 outbox_control_seq(void);
extern void outbox_wake_launcher(void);
extern void outbox_shared_register_launcher(int wait_ms);
extern void outbox_stop_relays(Oid dboid, int wait_ms);
extern int	outbox_slot_take(Oid dboid, const char *name);
extern void outbox_slot_free(int slot);
extern void outbox_set_unserved(const OutboxUnserved *list, int n);
extern int	outbox_take_created(Oid *dboids, bool *overflow);

/*
 * emit.c: writing events
 */
typedef struct OutboxEvent
{
	text	   *aggregate_type;
	text	   *aggregate_id;
	text	   *event_type;
	Jsonb	   *payload;		/* NULL: tombstone (or bytes below) */
	bytea	   *payload_bytes;	/* emit_bytes(): the value as is; else NULL */
	Jsonb	   *headers;		/* NULL: none */
	text	   *topic;			/* NULL: routed */
} OutboxEvent;

extern void outbox_validate_topic(text *topic, text *aggregate_type,
								  const char *context);
extern pg_uuid_t *outbox_insert_event(const OutboxEvent *event,
									  const char *context);
extern void outbox_register_wakeup_at_commit(bool control);

/*
 * worker.c: one relay, started by the launcher (launcher.c)
 */
extern const char *outbox_relay_database;	/* name of the relay's database */
extern PGDLLEXPORT void outbox_worker_main(Datum main_arg);

/*
 * outbox.c registers the launcher, launcher.c runs it
 */
extern void outbox_register_launcher(void);

struct BackgroundWorker;
extern void outbox_init_bgworker(struct BackgroundWorker *worker,
								 const char *function, const char *type,
								 int restart_time);
extern PGDLLEXPORT void outbox_launcher_main(Datum main_arg);

#endif							/* OUTBOX_H */
