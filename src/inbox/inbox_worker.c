/*-------------------------------------------------------------------------
 *
 * inbox_worker.c
 *	  An inbox worker: start-up and main loop.
 *
 * Its database's inbox launcher (inbox_launcher.c) starts one per slice
 * of each subscription: it applies that subscription's partitions of its
 * slice (inbox_partition_slice()), and nothing else, so a slow handler
 * holds only its own subscription.  The worker connects as the bootstrap
 * superuser (it must become the subscription's role to call its handler;
 * the handler itself never runs as a superuser, see inbox_handler.c) and
 * exits with code 0 when its subscription is gone or the extension was
 * dropped.
 *
 * The loop, like the relay's (worker.c): read the subscription again when
 * the SQL API changed it; look for new partitions now and then; apply what
 * the consumer has fetched, a batch per transaction; sleep on the latch
 * and librdkafka's wake-up pipe.  A paused subscription, or a restored
 * copy, is read but not consumed: its worker only shows its partitions
 * and their high watermarks.  Errors that escape a step are logged, shown
 * in outbox.inbox_status and followed by a backoff; the worker then reads
 * its offsets again, so nothing it consumed but did not commit is lost.
 * SIGTERM ends it at the next CHECK_FOR_INTERRUPTS (never inside
 * librdkafka): a batch not committed is consumed again.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "inbox/inbox.h"
#include "config/guc_refusal.h"
#include "shared/shmem.h"

#include <fcntl.h>
#include <unistd.h>

#include "access/xact.h"
#include "catalog/namespace.h"
#include "commands/extension.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "pgstat.h"
#include "postmaster/bgworker.h"
#include "postmaster/interrupt.h"
#include "storage/ipc.h"
#include "storage/latch.h"
#include "storage/lwlock.h"
#include "tcop/tcopprot.h"
#include "utils/guc.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"

/* backoff after an error that escaped a step, doubling up to the cap (ms) */
#define ERROR_BACKOFF_MIN_MS	1000
#define ERROR_BACKOFF_MAX_MS	10000
/* the worker looks for new partitions this often (ms) */
#define REFRESH_MS				10000
/* ... and while a subscription has none yet or Kafka is down */
#define REFRESH_BUSY_MS			2000
/* dead letters in a row, none applied, that make the state failing */
#define FAILING_IN_A_ROW		10
/* how long one topic's metadata may take (ms) */
#define METADATA_TIMEOUT_MS		2000
/* longest sleep between two passes (ms) */
#define IDLE_NAP_MS				1000

static List *subscriptions = NIL;	/* its subscription, or NIL */
static MemoryContext pass_context = NULL;
static int	wakeup_fd[2] = {-1, -1};
static InboxWorkerArgs worker_args;

/* state that must survive the longjmp of an error */
static int	error_backoff_ms = 0;
static bool reload_pending = true;
static bool attempts_begun = false;
static uint32 loaded_seq = 0;
static TimestampTz last_refresh = 0;
static TimestampTz last_problem_look = 0;
static rd_kafka_message_t **batch = NULL;
static int	batch_count = 0;

pg_noreturn static void inbox_loop(void);
static void recover_from_error(void);
static bool extension_exists(void);
pg_noreturn static void exit_gone(const char *why);
static bool unwatched(InboxSubscription *sub);
static void watch_unassigned(InboxSubscription *sub);
static void reload(void);
static void refresh(bool force);
static int	apply_ready(void);
static void drop_batch(void);
static void show_worker_state(void);
static void wait_for_work(long ms);
static void free_consumers_at_exit(int code, Datum arg);
static void forget_plans(void);

/*
 * outbox_inbox_worker_main
 *		Entry point of an inbox worker, started by its inbox launcher;
 *		main_arg is its entry in the pool, bgw_extra an InboxWorkerArgs
 *		naming the database, the subscription and the slice.  Never returns
 *		(see the file header).
 */
void
outbox_inbox_worker_main(Datum main_arg)
{
	pqsignal(SIGHUP, SignalHandlerForConfigReload);
	pqsignal(SIGTERM, inbox_attempts_sigterm);
	BackgroundWorkerUnblockSignals();

	memcpy(&worker_args, MyBgworkerEntry->bgw_extra, sizeof(worker_args));
	inbox_worker_register(DatumGetInt32(main_arg), worker_args.generation);
	BackgroundWorkerInitializeConnectionByOid(worker_args.dboid, InvalidOid, 0);

	/* the worker's own statements never resolve a name through users' schemas */
	SetConfigOption("search_path", "pg_catalog, pg_temp", PGC_SUSET, PGC_S_OVERRIDE);
	/* client timeouts are for clients; handlers get outbox.inbox_handler_timeout */
	SetConfigOption("statement_timeout", "0", PGC_SUSET, PGC_S_OVERRIDE);
	SetConfigOption("idle_in_transaction_session_timeout", "0", PGC_SUSET, PGC_S_OVERRIDE);
	outbox_disable_transaction_timeout();
	/* the offsets are written in every batch: a read-only default would loop */
	SetConfigOption("default_transaction_read_only", "off", PGC_SUSET, PGC_S_OVERRIDE);

	on_proc_exit(free_consumers_at_exit, (Datum) 0);
	if (pipe(wakeup_fd) != 0 ||
		fcntl(wakeup_fd[0], F_SETFL, O_NONBLOCK) != 0 ||
		fcntl(wakeup_fd[1], F_SETFL, O_NONBLOCK) != 0)
		ereport(FATAL,
				(errmsg("outbox inbox: could not create the wake-up pipe: %m")));
	pass_context = AllocSetContextCreate(TopMemoryContext, "outbox inbox pass",
										 ALLOCSET_DEFAULT_SIZES);
	batch = MemoryContextAlloc(TopMemoryContext,
							   sizeof(rd_kafka_message_t *) * 100000);
	outbox_reload_config_file();
	ereport(DEBUG1,
			(errmsg("outbox inbox started for subscription \"%s\" (slice %d of %d)",
					worker_args.subscription, worker_args.slice + 1,
					worker_args.nslices)));
	inbox_loop();
}

/*
 * Does the database have the extension (at 1.8 or later)?  Its own
 * transaction.
 */
static bool
extension_exists(void)
{
	bool		exists;

	SetCurrentStatementStartTimestamp();
	StartTransactionCommand();
	exists = OidIsValid(get_extension_oid(OUTBOX_EXTENSION_NAME, true)) &&
		OidIsValid(get_relname_relid("subscriptions",
									 get_namespace_oid(OUTBOX_SCHEMA, true)));
	CommitTransactionCommand();
	return exists;
}

/* exit with code 0: the subscription or the extension is gone */
static void
exit_gone(const char *why)
{
	ereport(LOG,
			(errmsg("outbox inbox for subscription \"%s\" exits: %s",
					worker_args.subscription, why)));
	proc_exit(0);
}

static void
inbox_loop(void)
{
	sigjmp_buf	local_sigjmp_buf;

	if (sigsetjmp(local_sigjmp_buf, 1) != 0)
		recover_from_error();
	PG_exception_stack = &local_sigjmp_buf;

	for (;;)
	{
		int			applied;

		CHECK_FOR_INTERRUPTS();
		if (ConfigReloadPending)
		{
			ConfigReloadPending = false;
			outbox_reload_config_file();
			inbox_config_reloaded = true;
		}
		/* a reload, here or before a handler call (inbox_handler.c) */
		if (inbox_config_reloaded)
		{
			inbox_config_reloaded = false;
			reload_pending = true;
		}
		MemoryContextReset(pass_context);
		MemoryContextSwitchTo(pass_context);

		if (inbox_shmem_control_seq() != loaded_seq)
			reload_pending = true;
		if (reload_pending)
			reload();
		refresh(false);
		if (reload_pending)
			continue;
		inbox_dedupe_rotate_if_due();
		applied = apply_ready();
		error_backoff_ms = 0;
		show_worker_state();
		if (applied == 0)
			wait_for_work(IDLE_NAP_MS);
	}
}

/*
 * Read the subscription and its offsets again, build the consumer if it is
 * missing, and assign this slice's partitions from the table.  Exits (code
 * 0) when the subscription or the extension is gone.
 */
static void
reload(void)
{
	bool		any;
	InboxSubscription *sub;
	const char *problem;
	char	   *refusal;
	int			i;

	loaded_seq = inbox_shmem_control_seq();
	inbox_status_release_all();
	forget_plans();
	if (!extension_exists())
		exit_gone("the extension was dropped");
	SetCurrentStatementStartTimestamp();
	StartTransactionCommand();
	PushActiveSnapshot(GetTransactionSnapshot());
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	subscriptions = inbox_load_subscriptions(subscriptions, worker_args.subscription,
											 worker_args.slice, worker_args.nslices,
											 &any);
	if (!any)
	{
		SPI_finish();
		PopActiveSnapshot();
		CommitTransactionCommand();
		exit_gone("it was dropped");
	}
	sub = linitial(subscriptions);
	/* once: the records earlier workers of this subscription ended in */
	if (!attempts_begun)
	{
		inbox_attempts_begin(sub);
		attempts_begun = true;
	}
	refusal = outbox_refusal_of(OUTBOX_REFUSABLE_INBOX_KAFKA_PROPERTIES);
	problem = inbox_subscription_problem(sub);
	if (!sub->copy)
	{
		inbox_offsets_load(sub);
		inbox_witness_restall(sub);
	}
	for (i = 0; i < sub->npartitions; i++)
		inbox_status_set(sub->partitions[i].status,
						 sub->paused ? INBOX_STATE_PAUSED : INBOX_STATE_ERROR,
						 sub->paused ? NULL : problem);
	if (refusal != NULL)
		inbox_set_state(INBOX_STATE_CONFIG_ERROR, refusal);
	else if (problem != NULL && !sub->paused && !sub->copy)
		inbox_set_state(INBOX_STATE_ERROR, problem);
	else if (!sub->copy && outbox_inbox_servers()[0] != '\0')
	{
		if (sub->consumer == NULL)
		{
			char	   *error = NULL;

			/* new settings: a new probe too */
			inbox_witness_destroy();
			sub->consumer = inbox_consumer_create(sub, wakeup_fd[1], &error);
			if (sub->consumer == NULL)
				inbox_set_state(INBOX_STATE_CONFIG_ERROR, error);
		}
		if (sub->consumer != NULL && !sub->paused)
			inbox_offsets_resolve_seeks(sub);
	}
	/* one that does not consume keeps its consumer, with nothing assigned */
	if (sub->consumer != NULL)
		sub->reassign = true;
	SPI_finish();
	PopActiveSnapshot();
	CommitTransactionCommand();
	reload_pending = false;
	last_refresh = 0;
}

/*
 * Look for new partitions (and topics) of the subscription: every
 * REFRESH_MS, more often while it has no partition yet or Kafka is down,
 * and at once when force.  Assigns the consumer when its partitions
 * changed.  A paused subscription only has its high watermarks read.
 */
static void
refresh(bool force)
{
	TimestampTz now = GetCurrentTimestamp();
	InboxSubscription *sub = subscriptions != NIL ? linitial(subscriptions) : NULL;
	bool		due = force || last_refresh == 0 ||
		TimestampDifferenceExceeds(last_refresh, now, REFRESH_MS);
	char		why[OUTBOX_ERROR_LEN];

	if (sub == NULL || sub->copy)
		return;
	if (sub->consumer != NULL &&
		(sub->npartitions < sub->ntopics || inbox_consumer_broker_down(sub, why, sizeof(why)) ||
		 unwatched(sub)) &&
		TimestampDifferenceExceeds(last_refresh, now, REFRESH_BUSY_MS))
		due = true;
	/* a handler created again, a setting allowing superusers: look again */
	if (TimestampDifferenceExceeds(last_problem_look, now, REFRESH_MS))
	{
		last_problem_look = now;
		if (!sub->paused && inbox_subscription_problem(sub) != NULL)
			reload_pending = true;
	}
	if (sub->reassign && sub->consumer != NULL)
		inbox_consumer_assign(sub);
	if (!due || sub->consumer == NULL)
		return;
	last_refresh = now;
	SetCurrentStatementStartTimestamp();
	StartTransactionCommand();
	PushActiveSnapshot(GetTransactionSnapshot());
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	if (!sub->paused && inbox_consumer_refresh(sub, METADATA_TIMEOUT_MS))
		inbox_offsets_resolve_seeks(sub);
	watch_unassigned(sub);
	SPI_finish();
	PopActiveSnapshot();
	CommitTransactionCommand();
	if (sub->reassign)
		inbox_consumer_assign(sub);
}

/* is a partition of this slice not fetched (paused, stalled) without a known end? */
static bool
unwatched(InboxSubscription *sub)
{
	int			i;

	for (i = 0; i < sub->npartitions; i++)
	{
		InboxPartition *p = &sub->partitions[i];

		if (p->status >= 0 && (sub->paused || p->stalled) && !p->watched)
			return true;
	}
	return false;
}

/*
 * The partitions of this slice that are not fetched (all of a paused
 * subscription, the stalled ones): ask Kafka for their high watermarks,
 * which no fetch brings, so that outbox.inbox_status shows the lag that
 * builds up; stops between two requests when asked to exit.
 */
static void
watch_unassigned(InboxSubscription *sub)
{
	int			i;

	for (i = 0; i < sub->npartitions; i++)
	{
		InboxPartition *p = &sub->partitions[i];
		int64		high;

		CHECK_FOR_INTERRUPTS();
		if (p->status < 0 || !(sub->paused || p->stalled))
			continue;
		if (!inbox_consumer_resolve_end(sub, p->topic, p->partition, &high))
			break;
		inbox_status_watermark(p->status, high);
		p->watched = true;
		if (sub->paused)
			inbox_status_set(p->status, INBOX_STATE_PAUSED, NULL);
	}
}

/*
 * Apply what the consumer has fetched: retried dead letters first (slice 0
 * only, so that no letter is retried twice at once), then a batch of
 * records.  Returns the records applied (any outcome), 0 when nothing was
 * waiting.
 */
static int
apply_ready(void)
{
	InboxSubscription *sub = subscriptions != NIL ? linitial(subscriptions) : NULL;
	int			n;

	if (sub == NULL || sub->consumer == NULL || !inbox_subscription_active(sub))
		return 0;
	if (sub->retry_pending)
		inbox_retry_dead(sub);
	if (sub->reassign)
		inbox_consumer_assign(sub);
	/* an assignment that has to wait: read nothing from the old positions */
	if (sub->reassign)
		return 0;
	n = inbox_consumer_poll(sub, batch, outbox_inbox_batch_size,
							outbox_inbox_batch_wait);
	if (n > 0)
	{
		batch_count = n;
		inbox_apply_batch(sub, batch, n);
		drop_batch();
	}
	inbox_consumer_watermarks(sub);
	return n;
}

/* destroy the records of the batch in hand */
static void
drop_batch(void)
{
	int			i;

	for (i = 0; i < batch_count; i++)
		rd_kafka_message_destroy(batch[i]);
	batch_count = 0;
}

/*
 * The worker's state: not_configured without servers, paused, broker_down
 * while the consumer reaches no broker, failing while every recent event
 * became a dead letter, running otherwise (config_error and error stay
 * until a reload fixes them).
 */
static void
show_worker_state(void)
{
	InboxSubscription *sub = subscriptions != NIL ? linitial(subscriptions) : NULL;
	char		why[OUTBOX_ERROR_LEN];

	if (sub == NULL || sub->copy)
		return;
	if (outbox_inbox_servers()[0] == '\0')
		inbox_set_state(INBOX_STATE_NOT_CONFIGURED,
						"outbox.inbox_bootstrap_servers and outbox.bootstrap_servers are empty");
	else if (sub->consumer == NULL || (!sub->paused && !inbox_subscription_active(sub)))
		return;					/* config_error or error, shown by reload() */
	else if (sub->paused)
		inbox_set_state(INBOX_STATE_PAUSED, NULL);
	else if (inbox_consumer_broker_down(sub, why, sizeof(why)))
		inbox_set_state(INBOX_STATE_BROKER_DOWN, why);
	else if (inbox_failing(FAILING_IN_A_ROW, why, sizeof(why)))
		inbox_set_state(INBOX_STATE_FAILING, why);
	else
		inbox_set_state(INBOX_STATE_RUNNING, NULL);
}

/*
 * Sleep up to ms until the latch is set (a control commit, SIGHUP,
 * SIGTERM) or librdkafka writes to the wake-up pipe; drain the pipe.
 */
static void
wait_for_work(long ms)
{
	char		buf[64];
	int			rc;

	rc = WaitLatchOrSocket(MyLatch,
						   WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH | WL_SOCKET_READABLE,
						   wakeup_fd[0], ms, outbox_wait_event(OUTBOX_WAIT_IDLE));
	if (rc & WL_LATCH_SET)
		ResetLatch(MyLatch);
	while (read(wakeup_fd[0], buf, sizeof(buf)) > 0)
		;
}

/*
 * After an ERROR escaped a step: clean up, show it, drop the batch in hand
 * (its records are read again from the offsets in the table), and sleep
 * with backoff.
 */
static void
recover_from_error(void)
{
	ErrorData  *edata;

	error_context_stack = NULL;
	HOLD_INTERRUPTS();
	AbortCurrentTransaction();
	/* DROP EXTENSION outbox makes every step fail: exit without an ERROR */
	if (!extension_exists())
	{
		FlushErrorState();
		exit_gone("the extension was dropped");
	}
	EmitErrorReport();
	LWLockReleaseAll();
	pgstat_report_wait_end();
	(void) inbox_handler_cleanup();
	MemoryContextSwitchTo(pass_context);
	edata = CopyErrorData();
	FlushErrorState();
	drop_batch();
	inbox_set_state(INBOX_STATE_ERROR, edata->message);
	inbox_event_forget();
	reload_pending = true;
	RESUME_INTERRUPTS();

	error_backoff_ms = error_backoff_ms == 0 ? ERROR_BACKOFF_MIN_MS :
		Min(error_backoff_ms * 2, ERROR_BACKOFF_MAX_MS);
	(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
					 error_backoff_ms, outbox_wait_event(OUTBOX_WAIT_ERROR_BACKOFF));
	ResetLatch(MyLatch);
}

/* drop the kept plans: the next use prepares them in the current schema */
static void
forget_plans(void)
{
	inbox_dedupe_forget_plans();
	inbox_dead_forget_plans();
	inbox_offsets_forget_plans();
	inbox_handler_forget_plans();
	inbox_event_forget();
}

/*
 * on_proc_exit: drop the consumer, so that librdkafka's threads end before
 * the process does (without waiting for brokers).
 */
static void
free_consumers_at_exit(int code, Datum arg)
{
	ListCell   *lc;

	drop_batch();
	inbox_witness_destroy();
	foreach(lc, subscriptions)
	{
		InboxSubscription *sub = lfirst(lc);

		inbox_consumer_destroy(sub->consumer);
		sub->consumer = NULL;
	}
}
