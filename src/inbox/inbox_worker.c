/*-------------------------------------------------------------------------
 *
 * inbox_worker.c
 *	  The inbox worker: start-up and main loop.
 *
 * The launcher starts one per covered database (inbox_launcher.c), in one
 * of the outbox.max_workers slots the relays use.  The worker connects to
 * the database as the bootstrap superuser (it must become each
 * subscription's role to call its handler; the handler itself never runs
 * as a superuser, see inbox_handler.c) and exits at once, with code 0, when
 * the database has no subscription: the launcher then starts none there
 * until outbox.subscribe() commits.
 *
 * The loop, like the relay's (worker.c): reload the subscriptions when the
 * SQL API changed them; look for new partitions now and then; apply what
 * each subscription's consumer has fetched, a batch per transaction; sleep
 * on the latch and librdkafka's wake-up pipe.  Errors that escape a step
 * are logged, shown in outbox.inbox_status and followed by a backoff; the
 * worker then reads its offsets again, so nothing it consumed but did not
 * commit is lost.  SIGTERM ends it at the next CHECK_FOR_INTERRUPTS
 * (never inside librdkafka): a batch not committed is consumed again.
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
/* how long one topic's metadata may take (ms) */
#define METADATA_TIMEOUT_MS		2000
/* longest sleep between two passes (ms) */
#define IDLE_NAP_MS				1000

static List *subscriptions = NIL;
static MemoryContext pass_context = NULL;
static int	wakeup_fd[2] = {-1, -1};
static const char *inbox_database = NULL;

/* state that must survive the longjmp of an error */
static int	error_backoff_ms = 0;
static bool reload_pending = true;
static uint32 loaded_seq = 0;
static TimestampTz last_refresh = 0;
static TimestampTz last_problem_look = 0;
static rd_kafka_message_t **batch = NULL;
static int	batch_count = 0;

pg_noreturn static void inbox_loop(void);
static void recover_from_error(void);
static bool inbox_has_subscriptions(void);
static void reload(void);
static void refresh(bool force);
static int	apply_ready(void);
static void drop_batch(void);
static void show_worker_state(void);
static void wait_for_work(long ms);
static void free_consumers_at_exit(int code, Datum arg);
static void forget_plans(void);

/*
 * outbox_inbox_main
 *		Entry point of an inbox worker, started by the launcher; main_arg is
 *		its slot in shared memory, bgw_extra an InboxArgs naming the
 *		database.  Never returns (see the file header).
 */
void
outbox_inbox_main(Datum main_arg)
{
	InboxArgs	args;

	pqsignal(SIGHUP, SignalHandlerForConfigReload);
	pqsignal(SIGTERM, inbox_attempts_sigterm);
	BackgroundWorkerUnblockSignals();

	memcpy(&args, MyBgworkerEntry->bgw_extra, sizeof(args));
	inbox_database = MemoryContextStrdup(TopMemoryContext, args.dbname);
	BackgroundWorkerInitializeConnectionByOid(args.dboid, InvalidOid, 0);

	/* the worker's own statements never resolve a name through users' schemas */
	SetConfigOption("search_path", "pg_catalog, pg_temp", PGC_SUSET, PGC_S_OVERRIDE);
	/* client timeouts are for clients; handlers get outbox.inbox_handler_timeout */
	SetConfigOption("statement_timeout", "0", PGC_SUSET, PGC_S_OVERRIDE);
	SetConfigOption("idle_in_transaction_session_timeout", "0", PGC_SUSET, PGC_S_OVERRIDE);
	outbox_disable_transaction_timeout();
	/* the offsets are written in every batch: a read-only default would loop */
	SetConfigOption("default_transaction_read_only", "off", PGC_SUSET, PGC_S_OVERRIDE);

	inbox_shmem_register(DatumGetInt32(main_arg));
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

	if (!inbox_has_subscriptions())
	{
		ereport(DEBUG1,
				(errmsg("outbox inbox for database \"%s\" exits: no subscription",
						inbox_database)));
		inbox_shmem_note_no_subscriptions();
		proc_exit(0);
	}
	inbox_shmem_note_serving();
	ereport(LOG,
			(errmsg("outbox inbox started for database \"%s\"", inbox_database)));
	inbox_attempts_begin(MyDatabaseId);
	inbox_loop();
}

/*
 * Does the database have the extension (at 1.8 or later) and a
 * subscription?  Its own transaction.
 */
static bool
inbox_has_subscriptions(void)
{
	bool		any = false;

	SetCurrentStatementStartTimestamp();
	StartTransactionCommand();
	PushActiveSnapshot(GetTransactionSnapshot());
	if (OidIsValid(get_extension_oid(OUTBOX_EXTENSION_NAME, true)) &&
		OidIsValid(get_relname_relid("subscriptions",
									 get_namespace_oid(OUTBOX_SCHEMA, true))))
	{
		if (SPI_connect() != SPI_OK_CONNECT)
			elog(ERROR, "SPI_connect failed");
		any = SPI_execute("SELECT 1 FROM outbox.subscriptions LIMIT 1", true, 1) == SPI_OK_SELECT &&
			SPI_processed > 0;
		SPI_finish();
	}
	PopActiveSnapshot();
	CommitTransactionCommand();
	return any;
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
 * Read the subscriptions and their offsets again, build the consumers that
 * are missing, and assign every partition from the table.  Exits (code 0,
 * launcher told) when no subscription is left.
 */
static void
reload(void)
{
	bool		any;
	ListCell   *lc;
	char	   *refusal;

	loaded_seq = inbox_shmem_control_seq();
	inbox_status_release_all();
	forget_plans();
	/* DROP EXTENSION outbox (or its last subscription) ends the worker */
	if (!inbox_has_subscriptions())
	{
		ereport(LOG,
				(errmsg("outbox inbox for database \"%s\" exits: no subscription left",
						inbox_database)));
		inbox_shmem_note_no_subscriptions();
		proc_exit(0);
	}
	SetCurrentStatementStartTimestamp();
	StartTransactionCommand();
	PushActiveSnapshot(GetTransactionSnapshot());
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	subscriptions = inbox_load_subscriptions(subscriptions, &any);
	if (!any)
	{
		SPI_finish();
		PopActiveSnapshot();
		CommitTransactionCommand();
		ereport(LOG,
				(errmsg("outbox inbox for database \"%s\" exits: no subscription left",
						inbox_database)));
		inbox_shmem_note_no_subscriptions();
		proc_exit(0);
	}
	refusal = outbox_refusal_of(OUTBOX_REFUSABLE_INBOX_KAFKA_PROPERTIES);
	foreach(lc, subscriptions)
	{
		InboxSubscription *sub = lfirst(lc);
		const char *problem = inbox_subscription_problem(sub);
		int			i;

		if (sub->paused || sub->copy)
			continue;
		inbox_offsets_load(sub);
		for (i = 0; problem != NULL && i < sub->npartitions; i++)
			inbox_status_set(sub->partitions[i].status, INBOX_STATE_ERROR, problem);
		if (problem != NULL || refusal != NULL || outbox_inbox_servers()[0] == '\0')
			continue;
		if (sub->consumer == NULL)
		{
			char	   *error = NULL;

			sub->consumer = inbox_consumer_create(sub, wakeup_fd[1], &error);
			if (sub->consumer == NULL)
			{
				inbox_set_state(INBOX_STATE_CONFIG_ERROR, error);
				continue;
			}
		}
		inbox_offsets_resolve_seeks(sub);
		sub->reassign = true;
	}
	SPI_finish();
	PopActiveSnapshot();
	CommitTransactionCommand();
	if (refusal != NULL)
		inbox_set_state(INBOX_STATE_CONFIG_ERROR, refusal);
	reload_pending = false;
	last_refresh = 0;
}

/*
 * Look for new partitions (and topics) of every consuming subscription:
 * every REFRESH_MS, more often while one has no partition yet, and at once
 * when force.  Assigns the consumers whose partitions changed.
 */
static void
refresh(bool force)
{
	TimestampTz now = GetCurrentTimestamp();
	bool		due = force || last_refresh == 0 ||
		TimestampDifferenceExceeds(last_refresh, now, REFRESH_MS);
	ListCell   *lc;

	foreach(lc, subscriptions)
	{
		InboxSubscription *sub = lfirst(lc);

		if (sub->consumer != NULL && sub->npartitions < sub->ntopics &&
			TimestampDifferenceExceeds(last_refresh, now, REFRESH_BUSY_MS))
			due = true;
	}
	/* a handler created again, a setting allowing superusers: look again */
	if (TimestampDifferenceExceeds(last_problem_look, now, REFRESH_MS))
	{
		last_problem_look = now;
		foreach(lc, subscriptions)
		{
			InboxSubscription *sub = lfirst(lc);

			if (!sub->paused && !sub->copy && inbox_subscription_problem(sub) != NULL)
				reload_pending = true;
		}
	}
	if (due)
	{
		last_refresh = now;
		SetCurrentStatementStartTimestamp();
		StartTransactionCommand();
		PushActiveSnapshot(GetTransactionSnapshot());
		if (SPI_connect() != SPI_OK_CONNECT)
			elog(ERROR, "SPI_connect failed");
		foreach(lc, subscriptions)
		{
			InboxSubscription *sub = lfirst(lc);

			if (sub->consumer == NULL)
				continue;
			if (inbox_consumer_refresh(sub, METADATA_TIMEOUT_MS))
				inbox_offsets_resolve_seeks(sub);
		}
		SPI_finish();
		PopActiveSnapshot();
		CommitTransactionCommand();
	}
	foreach(lc, subscriptions)
	{
		InboxSubscription *sub = lfirst(lc);

		if (sub->consumer != NULL && sub->reassign)
			inbox_consumer_assign(sub);
	}
}

/*
 * Apply what the consumers have fetched: per subscription, retried dead
 * letters first, then batches of records.  Returns the records applied
 * (any outcome), 0 when nothing was waiting.
 */
static int
apply_ready(void)
{
	int			total = 0;
	ListCell   *lc;

	foreach(lc, subscriptions)
	{
		InboxSubscription *sub = lfirst(lc);
		int			n;

		if (sub->consumer == NULL)
			continue;
		if (sub->retry_pending)
			inbox_retry_dead(sub);
		if (sub->reassign)
			inbox_consumer_assign(sub);
		n = inbox_consumer_poll(sub, batch, outbox_inbox_batch_size,
								outbox_inbox_batch_wait);
		if (n == 0)
		{
			inbox_consumer_watermarks(sub);
			continue;
		}
		batch_count = n;
		inbox_apply_batch(sub, batch, n);
		drop_batch();
		inbox_consumer_watermarks(sub);
		total += n;
	}
	return total;
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
 * The worker's state: not_configured without servers, broker_down while
 * a consumer reaches no broker, running otherwise (config_error stays
 * until a reload fixes it).
 */
static void
show_worker_state(void)
{
	ListCell   *lc;
	char		why[OUTBOX_ERROR_LEN];

	if (outbox_inbox_servers()[0] == '\0')
	{
		inbox_set_state(INBOX_STATE_NOT_CONFIGURED,
						"outbox.inbox_bootstrap_servers and outbox.bootstrap_servers are empty");
		return;
	}
	foreach(lc, subscriptions)
	{
		if (inbox_consumer_broker_down(lfirst(lc), why, sizeof(why)))
		{
			inbox_set_state(INBOX_STATE_BROKER_DOWN, why);
			return;
		}
	}
	foreach(lc, subscriptions)
		if (((InboxSubscription *) lfirst(lc))->consumer == NULL &&
			inbox_subscription_active(lfirst(lc)))
			return;				/* config_error, shown by reload() */
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
	EmitErrorReport();
	AbortCurrentTransaction();
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
 * on_proc_exit: drop the consumers, so that librdkafka's threads end before
 * the process does (without waiting for brokers).
 */
static void
free_consumers_at_exit(int code, Datum arg)
{
	ListCell   *lc;

	drop_batch();
	foreach(lc, subscriptions)
	{
		InboxSubscription *sub = lfirst(lc);

		inbox_consumer_destroy(sub->consumer);
		sub->consumer = NULL;
	}
}
