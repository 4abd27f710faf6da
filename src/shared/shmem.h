/*-------------------------------------------------------------------------
 *
 * shmem.h
 *	  Shared memory (shmem.c): the relay slots the launcher assigns, the
 *	  wake-up latches, and whether a relay publishes a database's outbox.
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_SHMEM_H
#define OUTBOX_SHMEM_H

#include "outbox.h"

#include "datatype/timestamp.h"
#include "miscadmin.h"
#include "storage/ipc.h"
#include "storage/latch.h"
#include "storage/spin.h"

/*
 * State shared between the relay worker and every backend.
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
	pid_t		vacuum_pid;		/* the relay's VACUUM worker (vacuum.c) while
								 * it runs, set by that worker; 0 if none */

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

/* does a relay publish this database's outbox? (shmem.c) */
typedef enum OutboxRelayCoverage
{
	OUTBOX_RELAYED,
	OUTBOX_NOT_PRELOADED,		/* no relay runs: not in shared_preload_libraries */
	OUTBOX_OTHER_DATABASE,		/* not covered by outbox.databases (or .database) */
	OUTBOX_UNSERVABLE_DATABASE	/* covered, but a template or closed to
								 * connections: no relay can connect */
} OutboxRelayCoverage;

extern OutboxRelayCoverage outbox_relay_coverage(char **dbname);

#endif							/* OUTBOX_SHMEM_H */
