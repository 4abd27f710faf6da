/*-------------------------------------------------------------------------
 *
 * inbox.h
 *	  Declarations shared by the files of the inbox, the receiving side of
 *	  the extension: workers that consume Kafka topics and apply each event
 *	  once in this database.
 *
 * The inbox's parts in this folder:
 *	- the SQL API (inbox_subscribe.c, inbox_ops.c, inbox_take.c),
 *	- a database's inbox launcher (inbox_launcher.c), which starts the
 *	  inbox workers (inbox_worker.c) of its subscriptions, each with its
 *	  Kafka consumer (inbox_consumer.c) and subscription
 *	  (inbox_subscription.c),
 *	- the apply transaction (inbox_apply.c): events (inbox_event.c),
 *	  handler calls (inbox_handler.c), offsets (inbox_offsets.c), seen ids
 *	  (inbox_dedupe.c), dead letters (inbox_dead.c).
 * Outside it, by the layering of src/README.md: its settings
 * (config/inbox_guc.c), its shared memory and status (shared/inbox_shmem.c,
 * shared/inbox_status.c), and how the launcher runs it
 * (launcher/launcher_inbox.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_INBOX_H
#define OUTBOX_INBOX_H

#include "outbox.h"

#include <librdkafka/rdkafka.h>

#include "config/inbox_guc.h"
#include "shared/inbox_shmem.h"

#include "fmgr.h"
#include "access/htup.h"
#include "access/tupdesc.h"
#include "utils/jsonb.h"
#include "utils/timestamp.h"
#include "utils/uuid.h"

/* Longest subscription name (bytes), so that it fits shared memory */
#define INBOX_NAME_MAX			(NAMEDATALEN - 1)

/* Most topics one subscription names (outbox.subscribe() refuses more) */
#define INBOX_MAX_TOPICS		1000

/*
 * One record as the handler sees it (outbox.inbox_event), built from a
 * Kafka message (inbox_event.c) or from a dead letter being retried.
 * Every pointer is palloc'd in the batch's memory or NULL.
 */
typedef struct InboxEvent
{
	const char *topic;
	int32		partition;
	int64		offset;
	text	   *key;			/* NULL: no key */
	bool		has_event_id;
	pg_uuid_t	event_id;
	text	   *event_type;
	text	   *aggregate_type;
	Jsonb	   *headers;		/* NULL: no headers */
	Jsonb	   *payload;		/* the value as JSON, or NULL */
	bytea	   *payload_bytes;	/* the value when not JSON, or NULL */
	bool		has_timestamp;
	TimestampTz timestamp;
	int64		dead_id;		/* retry: its outbox.inbox_dead id; else 0 */
	int			attempts;		/* retry: failed handler calls so far */
} InboxEvent;

extern void inbox_event_from_message(InboxEvent *ev,
									 const rd_kafka_message_t *msg);
extern Datum inbox_event_datum(const InboxEvent *ev, const char *subscription);
extern Datum inbox_event_array(InboxEvent **evs, int n, const char *subscription);
extern Oid	inbox_event_type_oid(void);
extern void inbox_event_forget(void);
extern void inbox_event_values(const InboxEvent *ev, const char *subscription,
							   Datum *values, char *nulls);
extern void inbox_event_from_row(InboxEvent *ev, HeapTuple row,
								 TupleDesc desc);

/* a partition of a subscription, as the worker tracks it */
typedef struct InboxPartition
{
	char	   *topic;
	int32		partition;
	int64		next_offset;	/* as committed: -2 first, -1 end, or >= 0 */
	int64		witness_offset; /* the last applied record's offset, or -1 */
	uint64		witness_hash;	/* ... and its fingerprint (inbox_witness.c) */
	int			status;			/* index in the shared status pool, or -1 */
	bool		mine;			/* in the calling worker's slice */
	bool		stalled;		/* Kafka no longer has next_offset */
	bool		watched;		/* its end was asked for while not fetched */
	bool		seek_pending;	/* a seek_time waits to be resolved */
} InboxPartition;

struct InboxConsumer;

/* a subscription as the worker knows it (inbox_subscription.c) */
typedef struct InboxSubscription
{
	char		name[NAMEDATALEN];
	int			slice;			/* the calling worker's slice ... */
	int			nslices;		/* ... of this many */
	Oid			owner;
	Oid			handler;		/* InvalidOid: queue mode */
	bool		batch_handler;	/* handler(outbox.inbox_event[]) */
	char	   *handler_text;	/* as stored; NULL in queue mode */
	bool		handler_missing;	/* the stored handler does not resolve */
	int			ntopics;
	char	  **topics;
	bool		hold;			/* on_failed_event = hold */
	bool		dedupe;
	char	   *start_from;		/* earliest, latest, an offset or a time */
	bool		started;
	bool		paused;
	bool		copy;			/* restored elsewhere: apply nothing */
	bool		refused;		/* owner is a superuser, not allowed */
	char	   *problem;		/* why it does not consume, or NULL */
	int			npartitions;
	int			maxpartitions;
	InboxPartition *partitions;
	struct InboxConsumer *consumer;
	int		   *topic_status;	/* per topic: status entry while missing */
	bool		has_dead;		/* dead letters exist (probe keys) */
	bool		retry_pending;	/* outbox.inbox_retry() asked */
	bool		reassign;		/* assign the consumer again */
	MemoryContext cxt;			/* everything of it but the consumer */
} InboxSubscription;

extern InboxPartition *inbox_find_partition(InboxSubscription *sub,
											const char *topic,
											int32 partition);
extern InboxPartition *inbox_add_partition(InboxSubscription *sub,
										   const char *topic,
										   int32 partition,
										   int64 next_offset);

/* inbox_subscription.c: the worker's list of subscriptions */
extern List *inbox_load_subscriptions(List *old, const char *name, int slice,
									  int nslices, bool *any);
extern void inbox_free_subscription(InboxSubscription *sub);
extern bool inbox_subscription_active(const InboxSubscription *sub);
extern const char *inbox_subscription_problem(const InboxSubscription *sub);
extern int64 inbox_start_offset(InboxSubscription *sub, const char *topic,
								int32 partition);
extern void inbox_note_missing_topic(InboxSubscription *sub, const char *topic);
extern void inbox_forget_missing_topic(InboxSubscription *sub,
									   const char *topic);

/* inbox_consumer.c: one librdkafka consumer per active subscription */
typedef struct InboxConsumer InboxConsumer;

extern rd_kafka_conf_t *inbox_consumer_conf(InboxSubscription *sub,
											 const char *const (*extra)[2],
											 char **error);
extern InboxConsumer *inbox_consumer_create(InboxSubscription *sub,
											int wakeup_fd, char **error);
extern void inbox_consumer_destroy(InboxConsumer *consumer);
extern bool inbox_consumer_settings_changed(InboxConsumer *consumer);
extern void inbox_consumer_assign(InboxSubscription *sub);
extern int	inbox_consumer_poll(InboxSubscription *sub,
								rd_kafka_message_t **msgs, int max,
								int wait_ms);
extern bool inbox_consumer_refresh(InboxSubscription *sub, int timeout_ms);
extern bool inbox_consumer_resolve_time(InboxSubscription *sub,
										const char *topic, int32 partition,
										TimestampTz when, int64 *offset);
extern bool inbox_consumer_resolve_start(InboxSubscription *sub,
										 const char *topic, int32 partition,
										 int64 *offset);
extern bool inbox_consumer_resolve_end(InboxSubscription *sub,
									   const char *topic, int32 partition,
									   int64 *offset);
extern void inbox_consumer_watermarks(InboxSubscription *sub);
extern bool inbox_consumer_broker_down(InboxSubscription *sub, char *why,
									   size_t len);

/* inbox_witness.c: a re-created topic told from the old one */
extern uint64 inbox_witness_hash(const rd_kafka_message_t *m);
extern void inbox_witness_request(InboxSubscription *sub,
								  rd_kafka_message_t **msgs, int n);
extern bool inbox_witness_verify(InboxSubscription *sub);
extern void inbox_witness_restall(InboxSubscription *sub);
extern void inbox_witness_destroy(void);

/* inbox_offsets.c: the offsets table */
extern void inbox_lock_subscription(InboxSubscription *sub);
extern void inbox_offsets_load(InboxSubscription *sub);
extern void inbox_offsets_insert(InboxSubscription *sub, const char *topic,
								 int32 partition, int64 next_offset);
extern void inbox_offsets_advance(InboxSubscription *sub,
								  InboxPartition *part, int64 next_offset,
								  uint64 witness_hash, int64 applied,
								  int64 duplicates);
extern void inbox_offsets_resolve_seeks(InboxSubscription *sub);
extern void inbox_mark_started(InboxSubscription *sub);
extern void inbox_offsets_forget_plans(void);

/* inbox_dedupe.c: the seen event ids */
extern void inbox_dedupe_begin_batch(void);
extern bool inbox_dedupe_seen(const char *subscription, const pg_uuid_t *id);
extern bool inbox_dedupe_record(const char *subscription, const pg_uuid_t *id);
extern void inbox_dedupe_seen_many(const char *subscription, const pg_uuid_t *ids,
								   int n, bool *seen);
extern void inbox_dedupe_record_many(const char *subscription,
									 const pg_uuid_t *ids, int n,
									 bool *recorded);
extern void inbox_dedupe_rotate_if_due(void);
extern void inbox_dedupe_forget_plans(void);

/* inbox_dead.c: dead letters and held keys */
extern bool inbox_dead_exist(const char *subscription);
extern bool inbox_key_held(const char *subscription, const InboxEvent *ev);
extern void inbox_dead_insert(const char *subscription, const InboxEvent *ev,
							  bool held, const char *error,
							  const char *sqlstate, int attempts);
extern bool inbox_retry_requested(const char *subscription);
extern int	inbox_dead_load_retry(const char *subscription, InboxEvent **events);
extern void inbox_dead_resolve(int64 dead_id);
extern void inbox_dead_failed_again(int64 dead_id, const char *error,
									const char *sqlstate, int attempts);
extern void inbox_dead_forget_plans(void);

/* inbox_handler.c: calling the handler, or queueing the event */
extern void inbox_handler_prepare(InboxSubscription *sub);
extern void inbox_apply_event(InboxSubscription *sub, const InboxEvent *ev);
extern void inbox_handler_enter(InboxSubscription *sub);
extern void inbox_handler_leave(void);
extern void inbox_handler_call(InboxSubscription *sub, const InboxEvent *ev);
extern void inbox_handler_call_batch(InboxSubscription *sub, InboxEvent **evs,
									 int n);
extern void inbox_queue_batch(InboxSubscription *sub, InboxEvent **evs, int n);
extern bool inbox_handler_cleanup(void);
extern bool inbox_config_reloaded;
extern const char *inbox_applying;
extern void inbox_handler_forget_plans(void);

/* inbox_apply.c: a batch of records in one transaction */
extern void inbox_apply_batch(InboxSubscription *sub,
							  rd_kafka_message_t **msgs, int n);
extern void inbox_retry_dead(InboxSubscription *sub);
extern bool inbox_sqlstate_is_transient(int sqlerrcode);

/* inbox_launcher.c: a database's inbox launcher */
extern PGDLLEXPORT void outbox_inbox_main(Datum main_arg);
extern int	inbox_partition_slice(const char *topic, int32 partition,
								  int nslices);

/* inbox_worker.c: an inbox worker */
extern PGDLLEXPORT void outbox_inbox_worker_main(Datum main_arg);

/* inbox_attempts.c: records that may crash the worker */
extern void inbox_attempts_begin(InboxSubscription *sub);
extern bool inbox_attempts_careful(InboxSubscription *sub, InboxPartition *part,
								   int64 offset);
extern void inbox_attempts_calling(const char *subscription,
								   const InboxEvent *ev, int64 last_offset);
extern void inbox_attempts_called(void);
extern void inbox_attempts_sigterm(SIGNAL_ARGS);
extern void inbox_attempts_end_batch(InboxSubscription *sub);
extern int	inbox_attempts_mark(InboxSubscription *sub, InboxPartition *part,
								int64 offset);

/*
 * A position in a partition, as subscribe()'s start_from and inbox_seek()
 * take it (inbox_subscribe.c): earliest ('-infinity'), latest
 * ('infinity'), an offset, or a time.
 */
typedef enum InboxPositionKind
{
	INBOX_POSITION_EARLIEST,
	INBOX_POSITION_LATEST,
	INBOX_POSITION_OFFSET,
	INBOX_POSITION_TIME
} InboxPositionKind;

typedef struct InboxPosition
{
	InboxPositionKind kind;
	int64		offset;			/* INBOX_POSITION_OFFSET */
	TimestampTz time;			/* INBOX_POSITION_TIME */
} InboxPosition;

extern void inbox_parse_position(const char *text, const char *what,
								 InboxPosition *pos);

/* the access checks of the SQL API (inbox_subscribe.c) */
extern Oid	inbox_check_manage(const char *name, Oid caller, bool drop,
							   bool *has_handler);
extern void inbox_switch_to_owner(Oid *save_userid, int *save_sec);
extern void inbox_switch_back(Oid save_userid, int save_sec);

#endif							/* OUTBOX_INBOX_H */
