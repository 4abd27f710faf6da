/*-------------------------------------------------------------------------
 *
 * inbox_shmem.h
 *	  What the inbox workers show in shared memory (inbox_shmem.c) and
 *	  outbox.inbox_worker_partitions() and outbox.cluster_status() read
 *	  (inbox_status.c): the inbox's part of shared/.
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_INBOX_SHMEM_H
#define OUTBOX_INBOX_SHMEM_H

#include "outbox.h"

#include "nodes/execnodes.h"
#include "storage/spin.h"
#include "utils/timestamp.h"

/* what the launcher hands an inbox worker in bgw_extra */
typedef struct InboxArgs
{
	Oid			dboid;			/* database to connect to */
	char		dbname[NAMEDATALEN];	/* its name when the worker was started */
} InboxArgs;

/*
 * inbox_shmem.c: what the inbox worker shows others (per worker slot of
 * outbox_shared, and a pool of partition entries) and how others reach it.
 */
typedef enum InboxState
{
	INBOX_STATE_STARTING = 0,
	INBOX_STATE_RUNNING,
	INBOX_STATE_NOT_CONFIGURED,
	INBOX_STATE_CONFIG_ERROR,
	INBOX_STATE_BROKER_DOWN,
	INBOX_STATE_ERROR,
	INBOX_STATE_STALLED,		/* partitions only */
	INBOX_STATE_WAITING_FOR_TOPIC	/* partition -1 of a topic */
} InboxState;

/* the area (inbox_shmem.c); the partition pool is inbox_partitions.c's */
#define INBOX_STATUS_PARTITIONS		512
#define INBOX_MAX_REQUESTS			16

typedef struct InboxWorkerShared
{
	slock_t		mutex;
	uint32		control_seq;	/* bumped at commit of the SQL API */
	bool		no_subscriptions;	/* the worker exits: nothing to consume */
	bool		serving;		/* it found subscriptions (a probe never does) */
	InboxState	state;
	int64		applied;		/* since the worker started */
	int64		dead;
	int64		errors;
	TimestampTz last_applied_at;
	TimestampTz last_error_at;
	char		last_error[OUTBOX_ERROR_LEN];
} InboxWorkerShared;

typedef struct InboxPartitionShared
{
	slock_t		mutex;
	int			owner;			/* slot of the worker using it; -1: free */
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
	int			nworkers;
	InboxWorkerShared *workers; /* nworkers of them */
	InboxPartitionShared *partitions;	/* INBOX_STATUS_PARTITIONS */
} InboxShared;

extern InboxShared *inbox_shared;
extern int	inbox_my_slot;		/* the calling worker's slot, or -1 */

/* copies for the status readers (inbox_status.c) */
typedef struct InboxWorkerCopy
{
	bool		serving;
	InboxState	state;
	int64		applied;
	int64		dead;
	int64		errors;
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

extern bool inbox_shmem_copy_worker(int slot, InboxWorkerCopy *out);
extern bool inbox_shmem_copy_partition(int i, InboxPartitionCopy *out);
extern int	inbox_shmem_npartitions(void);
extern const char *inbox_state_name(InboxState state);
extern Size outbox_inbox_shmem_size(void);
extern void outbox_inbox_shmem_init(void);
extern void inbox_shmem_register(int slot);
extern void inbox_shmem_note_no_subscriptions(void);
extern void inbox_shmem_note_serving(void);
extern bool inbox_shmem_slot_idle(int slot);
extern uint32 inbox_shmem_control_seq(void);
extern void inbox_set_state(InboxState state, const char *error);
extern void inbox_count(int64 applied, int64 dead, int64 errors);
extern int	inbox_status_claim(const char *subscription, const char *topic,
							   int32 partition);
extern void inbox_status_release_all(void);
extern void inbox_status_set(int entry, InboxState state, const char *error);
extern void inbox_status_watermark(int entry, int64 high);
extern void inbox_status_applied(int entry);
extern void outbox_inbox_wake(Oid dboid);
extern void outbox_inbox_wake_at_commit(void);
extern int	inbox_take_requests(Oid *dboids, int max, bool *overflow);

/* inbox_status.c: the inbox rows of outbox.cluster_status() */
extern void outbox_inbox_cluster_rows(ReturnSetInfo *rsinfo);


#endif							/* OUTBOX_INBOX_SHMEM_H */
