/*-------------------------------------------------------------------------
 *
 * inbox_shmem.h
 *	  What the inbox shows in shared memory (inbox_shmem.c, inbox_workers.c,
 *	  inbox_partitions.c) and outbox.inbox_worker_partitions() and
 *	  outbox.cluster_status() read (inbox_status.c): the inbox's part of
 *	  shared/.
 *
 * Two kinds of process serve a database's subscriptions:
 *	- its inbox launcher, started by the launcher in one of the
 *	  outbox.max_workers slots the relays use: it reads the subscriptions
 *	  and starts their inbox workers;
 *	- the inbox workers, outbox.inbox_workers_per_subscription per
 *	  subscription, each in an entry of a pool of outbox.inbox_max_workers:
 *	  they consume Kafka and apply the events.
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_INBOX_SHMEM_H
#define OUTBOX_INBOX_SHMEM_H

#include "outbox.h"

#include "nodes/execnodes.h"
#include "storage/latch.h"
#include "storage/spin.h"
#include "utils/timestamp.h"

/* what the launcher hands an inbox launcher in bgw_extra */
typedef struct InboxArgs
{
	Oid			dboid;			/* database to connect to */
	char		dbname[NAMEDATALEN];	/* its name when it was started */
} InboxArgs;

/* what an inbox launcher hands an inbox worker in bgw_extra */
typedef struct InboxWorkerArgs
{
	Oid			dboid;
	int			launcher_slot;	/* the slot of the inbox launcher */
	int			slice;			/* this worker's share of the partitions ... */
	int			nslices;		/* ... of this many */
	uint32		generation;		/* of its pool entry's claim */
	char		subscription[NAMEDATALEN];
} InboxWorkerArgs;

typedef enum InboxState
{
	INBOX_STATE_STARTING = 0,
	INBOX_STATE_RUNNING,
	INBOX_STATE_NOT_CONFIGURED,
	INBOX_STATE_CONFIG_ERROR,
	INBOX_STATE_BROKER_DOWN,
	INBOX_STATE_ERROR,
	INBOX_STATE_STALLED,		/* partitions only */
	INBOX_STATE_WAITING_FOR_TOPIC,	/* partition -1 of a topic */
	INBOX_STATE_WAITING_FOR_WORKER, /* no inbox worker could start */
	INBOX_STATE_FAILING,		/* every recent event failed or waits */
	INBOX_STATE_PAUSED
} InboxState;

#define INBOX_STATUS_PARTITIONS		512
#define INBOX_MAX_REQUESTS			16

/* per outbox slot: the inbox launcher that runs in it */
typedef struct InboxLauncherShared
{
	slock_t		mutex;
	uint32		control_seq;	/* bumped at commit of the SQL API */
	bool		no_subscriptions;	/* it exits: nothing to consume */
	uint32		idle_seq;		/* control_seq when it said so */
	bool		serving;		/* it found subscriptions (a probe never does) */
	InboxState	state;			/* running, or waiting_for_worker */
	TimestampTz last_error_at;
	char		last_error[OUTBOX_ERROR_LEN];
} InboxLauncherShared;

/* per entry of the pool: an inbox worker, claimed by its inbox launcher */
typedef struct InboxWorkerShared
{
	slock_t		mutex;
	bool		in_use;			/* claimed for a subscription's slice */
	uint32		generation;		/* bumped at each claim */
	int			launcher_slot;	/* outbox slot of the launcher that claimed it */
	Oid			dboid;
	char		subscription[NAMEDATALEN];
	int			slice;
	int			nslices;
	pid_t		pid;			/* 0 until the worker runs */
	Latch	   *latch;
	uint32		control_seq;	/* bumped at commit of the SQL API */
	InboxState	state;
	int64		applied;		/* since the worker started */
	int64		dead;
	int64		errors;
	TimestampTz started_at;
	TimestampTz last_applied_at;
	TimestampTz last_error_at;
	char		last_error[OUTBOX_ERROR_LEN];
} InboxWorkerShared;

typedef struct InboxPartitionShared
{
	slock_t		mutex;
	int			owner;			/* pool entry of the worker using it; -1: free */
	pid_t		pid;
	Oid			dboid;
	char		subscription[NAMEDATALEN];
	char		topic[OUTBOX_TOPIC_MAX_LEN + 1];
	int32		partition;
	int64		high_watermark; /* -1: not known yet */
	InboxState	state;
	TimestampTz last_error_at;
	TimestampTz last_applied_at;
	char		last_error[OUTBOX_ERROR_LEN];
} InboxPartitionShared;

typedef struct InboxShared
{
	slock_t		mutex;			/* protects the requests */
	int			nrequests;
	bool		requests_overflow;
	Oid			requests[INBOX_MAX_REQUESTS];
	int			nlaunchers;
	InboxLauncherShared *launchers; /* nlaunchers (outbox.max_workers) */
	int			nworkers;
	InboxWorkerShared *workers; /* nworkers (outbox.inbox_max_workers) */
	InboxPartitionShared *partitions;	/* INBOX_STATUS_PARTITIONS */
} InboxShared;

extern InboxShared *inbox_shared;
extern int	inbox_my_slot;		/* the calling inbox launcher's slot, or -1 */
extern int	inbox_my_entry;		/* the calling inbox worker's entry, or -1 */

/* copies for the status readers (inbox_status.c) */
typedef struct InboxLauncherCopy
{
	bool		serving;
	InboxState	state;
	TimestampTz last_error_at;
	char		last_error[OUTBOX_ERROR_LEN];
} InboxLauncherCopy;

typedef struct InboxWorkerCopy
{
	Oid			dboid;
	int			launcher_slot;
	char		subscription[NAMEDATALEN];
	int			slice;
	int			nslices;
	pid_t		pid;
	InboxState	state;
	int64		applied;
	int64		dead;
	int64		errors;
	TimestampTz started_at;
	TimestampTz last_applied_at;
	TimestampTz last_error_at;
	char		last_error[OUTBOX_ERROR_LEN];
} InboxWorkerCopy;

typedef struct InboxPartitionCopy
{
	pid_t		pid;
	Oid			dboid;
	char		subscription[NAMEDATALEN];
	char		topic[OUTBOX_TOPIC_MAX_LEN + 1];
	int32		partition;
	int64		high_watermark;
	InboxState	state;
	TimestampTz last_error_at;
	TimestampTz last_applied_at;
	char		last_error[OUTBOX_ERROR_LEN];
} InboxPartitionCopy;

/* inbox_shmem.c: the area, the inbox launchers, the wake-ups */
extern Size outbox_inbox_shmem_size(void);
extern void outbox_inbox_shmem_init(void);
extern void inbox_shmem_register(int slot);
extern bool inbox_shmem_note_no_subscriptions(uint32 seen_seq);
extern void inbox_shmem_note_serving(void);
extern bool inbox_shmem_slot_idle(int slot);
extern uint32 inbox_shmem_control_seq(void);
extern void inbox_launcher_set_state(InboxState state, const char *error);
extern bool inbox_shmem_copy_launcher(int slot, InboxLauncherCopy *out);
extern void outbox_inbox_wake(Oid dboid);
extern void outbox_inbox_wake_at_commit(void);
extern int	inbox_take_requests(Oid *dboids, int max, bool *overflow);
extern const char *inbox_state_name(InboxState state);

/* inbox_workers.c: the pool of inbox workers */
extern int	inbox_worker_claim(Oid dboid, const char *subscription, int slice,
							   int nslices, uint32 *generation);
extern void inbox_worker_release(int entry, uint32 generation);
extern void inbox_worker_set_waiting(int entry, const char *error);
extern void inbox_worker_register(int entry, uint32 generation);
extern void inbox_set_state(InboxState state, const char *error);
extern void inbox_count(int64 applied, int64 dead, int64 errors);
extern void inbox_note_dead(const char *error);
extern bool inbox_failing(int in_a_row, char *why, size_t len);
extern bool inbox_shmem_copy_worker(int entry, InboxWorkerCopy *out);
extern int	inbox_shmem_nworkers(void);

/* inbox_partitions.c: the pool of partition entries */
extern int	inbox_status_claim(const char *subscription, const char *topic,
							   int32 partition);
extern void inbox_status_release_all(void);
extern void inbox_status_set(int entry, InboxState state, const char *error);
extern void inbox_status_watermark(int entry, int64 high);
extern void inbox_status_applied(int entry);
extern bool inbox_shmem_copy_partition(int i, InboxPartitionCopy *out);
extern int	inbox_shmem_npartitions(void);

/* inbox_status.c: the inbox rows of outbox.cluster_status() */
extern void outbox_inbox_cluster_rows(ReturnSetInfo *rsinfo);

#endif							/* OUTBOX_INBOX_SHMEM_H */
