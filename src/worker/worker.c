/*-------------------------------------------------------------------------
 *
 * worker.c
 *	  A relay background worker: start-up, main loop.
 *
 * The launcher starts one per relayed database (launcher.c).  The worker
 * connects to that database (connect.c) and loops: delete
 * expired published rows (retention.c), claim and publish a batch
 * (batch.c), then sleep on its latch until a committing transaction wakes
 * it (emit.c), librdkafka has events for it (producer.c), or
 * outbox.poll_interval passes.  Each pass ends by telling what the batch
 * said about Kafka (status.c) and how long to sleep.
 *
 * It follows the pattern of worker_spi and pg_cron: core signal handlers
 * (die for SIGTERM, so interrupts are only processed at
 * CHECK_FOR_INTERRUPTS, never inside librdkafka), a non-zero exit whenever
 * it wants to be restarted, nothing raised as ERROR for conditions that are
 * normal (database or extension not there yet, broker down), and errors
 * that do happen logged and retried with backoff instead of a crash loop.
 * State changes are logged once, not once per event (status.c).
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "worker/worker.h"
#include "config/guc.h"
#include "config/guc_refusal.h"
#include "exactly_once/exactly_once.h"
#include "kafka/producer.h"
#include "relay/relay.h"
#include "relay/retention.h"
#include "shared/partition.h"
#include "shared/shmem.h"
#include "shared/status.h"
#include "worker/batch.h"
#include "worker/connect.h"

#include <malloc.h>

#include "access/xact.h"
#include "miscadmin.h"
#include "pgstat.h"
#include "postmaster/bgworker.h"
#include "postmaster/interrupt.h"
#include "storage/ipc.h"
#include "storage/latch.h"
#include "storage/lwlock.h"
#include "tcop/tcopprot.h"
#include "utils/guc.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"

/* backoff after an unexpected error, doubling up to the cap */
#define ERROR_BACKOFF_MIN_MS	1000
#define ERROR_BACKOFF_MAX_MS	10000

static OutboxProducer *producer = NULL;
static char *last_config_error = NULL;
static MemoryContext worker_context = NULL;

/* backoff after errors; static so that it survives the longjmp */
static int	error_backoff_ms = 0;

pg_noreturn static void relay_loop(void);
pg_noreturn static void retire(void);
static void recover_from_error(void);
static void wait_out(long ms, OutboxWait wait, bool control_ends_it,
					 uint32 control_seq);
static long relay_step(void);
static long rebuild_failed_producer(void);
static bool ensure_producer(void);
static bool start_transactions(char **error);
static void enter_config_error(const char *what, const char *error,
							   const char *hint);
static void reload_config(void);
static void destroy_producer_at_exit(int code, Datum arg);
static void keep_freed_memory(void);

/*
 * The relay allocates and frees the same few megabytes per batch: the
 * messages librdkafka copies (freed by the delivery reports), the SPI
 * tuple tables, the batch's memory contexts.  With glibc's defaults the
 * freed top of the heap is given back to the kernel (brk) after most
 * batches and faulted in again, page by page, for the next one: about a
 * tenth of the relay's CPU while it drains a backlog.  So the relay
 * process (only it) keeps up to 64 MB of freed heap (the size of
 * librdkafka's local queue, queue.buffering.max.kbytes), and takes blocks
 * of up to 32 MB from the heap instead of mmap (glibc's own upper bound
 * for its dynamic threshold).  Only the allocator's reuse changes.
 */
static void
keep_freed_memory(void)
{
#ifdef M_TRIM_THRESHOLD
	(void) mallopt(M_MMAP_THRESHOLD, 32 * 1024 * 1024);
	(void) mallopt(M_TRIM_THRESHOLD, 64 * 1024 * 1024);
#endif
}

/*
 * outbox_worker_main
 *		Entry point of a relay worker, started by the launcher (launcher.c);
 *		main_arg is the number of its slot in shared memory (an int32), and
 *		bgw_extra says which database to serve (OutboxRelayArgs).
 *
 * Never returns: the loop ends with the process, by SIGTERM (FATAL at a
 * CHECK_FOR_INTERRUPTS) or postmaster death, or, with outbox.databases =
 * '*', with exit code 0 when the database has no extension (then the
 * launcher starts no relay there until CREATE EXTENSION outbox).  Errors
 * inside the loop are caught and retried (relay_loop); a FATAL while
 * connecting makes the launcher start the worker again after a delay.
 */
void
outbox_worker_main(Datum main_arg)
{
	pqsignal(SIGHUP, SignalHandlerForConfigReload);
	pqsignal(SIGTERM, die);
	BackgroundWorkerUnblockSignals();
	keep_freed_memory();

	outbox_connect_to_database();

	worker_context = AllocSetContextCreate(TopMemoryContext, "outbox relay",
										   ALLOCSET_DEFAULT_SIZES);

	/*
	 * Our queries qualify every name, but the worker also never resolves an
	 * unqualified function or operator from a schema users can write to.
	 */
	SetConfigOption("search_path", "pg_catalog, pg_temp", PGC_SUSET,
					PGC_S_OVERRIDE);

	/*
	 * Every query of the relay reads a few rows in index order (oldest
	 * pending, oldest published, by primary key).  Its plans must not flip
	 * to a full scan and sort when the statistics are stale, e.g. when the
	 * outbox was analyzed empty and then filled with a backlog: that would
	 * make each batch cost as much as the whole table.
	 */
	SetConfigOption("enable_seqscan", "off", PGC_SUSET, PGC_S_OVERRIDE);
	SetConfigOption("enable_sort", "off", PGC_SUSET, PGC_S_OVERRIDE);
	/* those disabled paths cost 1e10, which would make every claim JIT-compile */
	SetConfigOption("jit", "off", PGC_SUSET, PGC_S_OVERRIDE);

	/*
	 * A batch's transaction stays open while Kafka acknowledges the batch,
	 * up to outbox.delivery_timeout, and longer while Kafka is slow.  A
	 * timeout meant for client sessions (transaction_timeout set for the
	 * server, the database or the role) would end the relay with FATAL
	 * every time, in a loop.  Like autovacuum, the relay is not bound by
	 * them; lock_timeout still applies (a blocked claim is an error that
	 * outbox.status shows, then retried).
	 */
	SetConfigOption("statement_timeout", "0", PGC_SUSET, PGC_S_OVERRIDE);
	SetConfigOption("idle_in_transaction_session_timeout", "0", PGC_SUSET,
					PGC_S_OVERRIDE);
	outbox_disable_transaction_timeout();

	/*
	 * Every batch records what Kafka acknowledged in the same transaction
	 * that read it.  A database or role made read-only for its clients
	 * (ALTER DATABASE/ROLE ... SET default_transaction_read_only) would have
	 * the relay send each batch, fail to record it, and send it again at
	 * every retry, and keep the setting for its session's life even after
	 * a RESET.  Like the timeouts, it is not meant for the relay.
	 */
	SetConfigOption("default_transaction_read_only", "off", PGC_SUSET,
					PGC_S_OVERRIDE);

	outbox_shared_register_worker(DatumGetInt32(main_arg), outbox_relay_worker,
								  outbox_relay_nworkers);
	on_proc_exit(destroy_producer_at_exit, (Datum) 0);

	/* a SIGHUP that arrived before our handler was installed is not lost */
	outbox_reload_config_file();

	if (!outbox_relay_has_extension())
		outbox_exit_without_extension(false);
	outbox_shared_note_extension();
	outbox_shared_wait_for_others();

	if (outbox_relay_nworkers > 1)
		ereport(LOG,
				(errmsg("outbox relay %d of %d started for database \"%s\" (key buckets %d to %d)",
						outbox_relay_worker + 1, outbox_relay_nworkers,
						outbox_relay_database,
						outbox_bucket_first(outbox_relay_worker, outbox_relay_nworkers),
						outbox_bucket_first(outbox_relay_worker + 1, outbox_relay_nworkers) - 1)));
	else
		ereport(LOG,
				(errmsg("outbox relay started for database \"%s\"",
						outbox_relay_database)));

	relay_loop();
}

/*
 * The main loop.  Errors raised inside a step are caught here, logged once,
 * and followed by a backoff, in the manner of PostgreSQL's own auxiliary
 * processes.
 */
static void
relay_loop(void)
{
	sigjmp_buf	local_sigjmp_buf;

	if (sigsetjmp(local_sigjmp_buf, 1) != 0)
		recover_from_error();
	PG_exception_stack = &local_sigjmp_buf;

	for (;;)
	{
		long		sleep_ms;
		int			events;
		int			rc;
		uint32		control_seq;

		CHECK_FOR_INTERRUPTS();
		if (ConfigReloadPending)
			reload_config();
		if (outbox_shared_retiring())
			retire();

		MemoryContextReset(worker_context);
		MemoryContextSwitchTo(worker_context);
		control_seq = outbox_control_seq();
		sleep_ms = relay_step();
		error_backoff_ms = 0;

		if (sleep_ms <= 0)
			continue;

		/*
		 * Paused: every commit that emits still sets our latch, and looking
		 * at outbox.relay for each would cost the emitting sessions CPU for
		 * nothing.  Sleep the poll interval, or until resume() commits.
		 */
		if (outbox_relay_state() == OUTBOX_STATE_PAUSED)
		{
			wait_out(sleep_ms, OUTBOX_WAIT_PAUSED, true, control_seq);
			if (producer != NULL)
				outbox_producer_serve(producer);
			continue;
		}

		events = WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH;
		if (producer != NULL)
			events |= WL_SOCKET_READABLE;
		rc = WaitLatchOrSocket(MyLatch, events,
							   producer ? producer->wakeup_fd[0] : PGINVALID_SOCKET,
							   sleep_ms, outbox_wait_event(OUTBOX_WAIT_IDLE));
		if (rc & WL_LATCH_SET)
			ResetLatch(MyLatch);
		if (producer != NULL)
			outbox_producer_serve(producer);
	}
}

/*
 * The launcher asked us to exit (outbox.workers_per_database changed, or
 * the slots for it did): we are between batches, with
 * nothing claimed and nothing in flight, so the next generation of relays
 * starts where we stopped.  Exit code 0: the launcher does not restart us.
 */
static void
retire(void)
{
	outbox_wake_launcher();
	ereport(LOG,
			(errmsg("outbox relay %d of %d for database \"%s\" exits between two batches: the launcher restarts the database's relays in another number",
					outbox_relay_worker + 1, outbox_relay_nworkers,
					outbox_relay_database),
			 errdetail("outbox.workers_per_database or the free worker slots changed.")));
	proc_exit(0);
}

/*
 * Clean up after an ERROR escaped a relay step, then sleep with backoff so
 * that a persistent problem is logged every few seconds at most, never in a
 * tight loop.
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

	MemoryContextSwitchTo(worker_context);
	edata = CopyErrorData();
	FlushErrorState();

	/*
	 * Show the failure in outbox.status until a step succeeds again; a
	 * broker outage stays broker_down (its own end is logged from there).
	 * The error is recorded every time, not only when the state changes:
	 * while one problem is fixed another may show up, and the status must
	 * name the one that stops the relay now.
	 */
	outbox_status_set_error(edata->message);
	if (outbox_relay_state() != OUTBOX_STATE_BROKER_DOWN)
		outbox_enter_state(OUTBOX_STATE_ERROR, NULL);

	/*
	 * What the failed step left in librdkafka is not ours any more.  With
	 * exactly_once the step may have failed after Kafka committed: a new
	 * producer reads the progress back before anything is sent.
	 */
	if (producer != NULL && producer->transactional_id != NULL)
	{
		outbox_producer_destroy(producer);
		producer = NULL;
	}
	else if (producer != NULL)
		outbox_producer_abort_batch(producer);

	RESUME_INTERRUPTS();

	error_backoff_ms = error_backoff_ms == 0 ? ERROR_BACKOFF_MIN_MS :
		Min(error_backoff_ms * 2, ERROR_BACKOFF_MAX_MS);
	wait_out(error_backoff_ms, OUTBOX_WAIT_ERROR_BACKOFF, false, 0);
}

/*
 * Sleep for ms, whatever sets the latch in between: every commit that
 * emitted does, and a relay that fails on each claim (a revoked privilege,
 * say) must not fail once per commit.  Only SIGTERM (by way of
 * CHECK_FOR_INTERRUPTS), SIGHUP (the fix may be a new setting) and, if
 * control_ends_it, a control commit after control_seq was read (resume(),
 * see outbox_wake_worker) cut it short.  pg_stat_activity shows wait.
 */
static void
wait_out(long ms, OutboxWait wait, bool control_ends_it, uint32 control_seq)
{
	TimestampTz deadline = TimestampTzPlusMilliseconds(GetCurrentTimestamp(), ms);

	for (;;)
	{
		long		left;

		CHECK_FOR_INTERRUPTS();
		if (ConfigReloadPending)
			break;
		if (control_ends_it && outbox_control_seq() != control_seq)
			break;
		if (outbox_shared_retiring())
			break;
		left = TimestampDifferenceMilliseconds(GetCurrentTimestamp(), deadline);
		if (left <= 0)
			break;
		(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
						 left, outbox_wait_event(wait));
		ResetLatch(MyLatch);
	}
}

/*
 * One pass of the loop: retention, a batch, and what the batch tells about
 * Kafka.  Returns how long to sleep (ms) before the next pass, or 0 to go
 * on at once (a full batch: more is probably waiting).
 */
static long
relay_step(void)
{
	OutboxBatchResult result;

	/* retention works whatever the state of Kafka */
	outbox_relay_cleanup_if_due();

	if (outbox_bootstrap_servers == NULL || outbox_bootstrap_servers[0] == '\0')
	{
		if (producer != NULL)
		{
			outbox_producer_destroy(producer);
			producer = NULL;
		}
		outbox_enter_state(OUTBOX_STATE_NOT_CONFIGURED, NULL);
		return outbox_poll_interval;
	}

	if (!ensure_producer())
		return outbox_poll_interval;

	outbox_relay_batch(producer, &result);
	/* SIGTERM during the batch: it was cut short and marked; exit now */
	CHECK_FOR_INTERRUPTS();

	if (result.table_missing)
	{
		if (strcmp(outbox_databases, "*") == 0)
			outbox_exit_without_extension(true);
		outbox_enter_state(OUTBOX_STATE_WAITING_FOR_EXTENSION, NULL);
		return outbox_poll_interval;
	}
	if (result.paused)
	{
		outbox_enter_state(OUTBOX_STATE_PAUSED, NULL);
		return outbox_poll_interval;
	}

	outbox_report_batch(&result);
	if (result.fatal)
		return rebuild_failed_producer();

	/*
	 * Row-tracked events were due, but each waits behind a failed event of
	 * its aggregate (on_failed_event = hold): the next pass turns to the
	 * snapshot batch.  It runs at once, or the relay would drain one
	 * snapshot batch per poll interval while such an event is held; and
	 * the state is left for that batch to tell.
	 */
	if (result.rows_held && !result.aborted)
	{
		producer = outbox_eos_alternate(producer);
		return 0;
	}
	outbox_update_broker_state(producer, &result);
	/* exactly_once: the next batch goes out through the other producer */
	producer = outbox_eos_alternate(producer);

	/*
	 * More is probably waiting after a full batch, and after any progress
	 * (events held back behind a retried one become claimable once it went
	 * out); an empty claim costs about a millisecond.
	 */
	if ((result.claimed >= outbox_batch_size || result.published > 0) &&
		!result.aborted)
		return 0;
	return outbox_poll_interval;
}

/*
 * The producer failed fatally during the batch: say why, drop it, and
 * return how long to sleep (ms) before the next pass builds a new one.
 */
static long
rebuild_failed_producer(void)
{
	rd_kafka_resp_err_t code;
	char	   *error = outbox_producer_fatal_error(producer, &code);

	/*
	 * A refused event stops the producer on purpose (gapless guarantee,
	 * see kafka_config.c); the refusal is recorded on the event, so this is
	 * routine.  Anything else is worth a WARNING.
	 */
	ereport(code == RD_KAFKA_RESP_ERR__GAPLESS_GUARANTEE ? DEBUG1 : WARNING,
			(errmsg("outbox relay: Kafka producer failed fatally, creating a new one"),
			 errdetail("%s", error ? error : "unknown error"),
			 errhint("Events not acknowledged stay unpublished and are sent again.")));
	if (code != RD_KAFKA_RESP_ERR__GAPLESS_GUARANTEE)
		outbox_status_set_error(error ? error : "fatal producer error");
	outbox_producer_destroy(producer);
	producer = NULL;
	return code == RD_KAFKA_RESP_ERR__GAPLESS_GUARANTEE ? 0 : 1000;
}

/*
 * Make sure a producer exists; build one from the current settings.  A bad
 * configuration is logged once (until it changes) and the worker waits for
 * a reload: it never exits over it, so there is no crash loop.
 */
static bool
ensure_producer(void)
{
	char	   *error;

	if (producer != NULL)
		return true;

	error = outbox_config_refusal();
	if (error == NULL)
		producer = outbox_producer_create(outbox_delivery == OUTBOX_DELIVERY_EXACTLY_ONCE ?
										  outbox_eos_transactional_id() : NULL,
										  &error);
	if (producer != NULL && producer->transactional_id != NULL &&
		!start_transactions(&error))
		return false;
	if (producer != NULL)
	{
		if (last_config_error != NULL)
		{
			pfree(last_config_error);
			last_config_error = NULL;
		}
		return true;
	}

	enter_config_error("create its Kafka producer", error,
					   outbox_delivery == OUTBOX_DELIVERY_EXACTLY_ONCE ?
					   "Fix outbox.bootstrap_servers, outbox.kafka_properties, outbox.message_format or outbox.ce_source and reload the configuration. With outbox.delivery = exactly_once, transaction.timeout.ms (librdkafka's default: 60000 ms) must not be below outbox.delivery_timeout." :
					   "Fix outbox.bootstrap_servers, outbox.kafka_properties, outbox.message_format or outbox.ce_source and reload the configuration.");
	return false;
}

/*
 * The relay cannot go on with the current settings: say so in the log once
 * (until the error changes: the worker waits for a reload and must not log
 * every poll), and show it in outbox.status as config_error.  what completes
 * "outbox relay cannot ...".
 */
static void
enter_config_error(const char *what, const char *error, const char *hint)
{
	if (last_config_error == NULL || strcmp(last_config_error, error) != 0)
	{
		ereport(LOG,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("outbox relay cannot %s: %s", what, error),
				 errhint("%s", hint)));
		if (last_config_error != NULL)
			pfree(last_config_error);
		last_config_error = MemoryContextStrdup(TopMemoryContext, error);
	}
	outbox_status_set_error(error);
	outbox_enter_state(OUTBOX_STATE_CONFIG_ERROR, NULL);
}

/*
 * exactly_once: initialize the new producer's transactions and read the
 * progress back (exactly_once.c).  When Kafka does not answer, the relay is
 * broker_down and tries again after the poll interval; a refusal (progress
 * topic with several partitions or deletion retention, transactions not
 * allowed) is a config_error, logged once until it changes, like a bad
 * setting.
 */
static bool
start_transactions(char **error)
{
	OutboxEosStart start = outbox_eos_start(producer, error);

	if (start == OUTBOX_EOS_READY)
	{
		ereport(LOG,
				(errmsg("outbox relay: exactly-once delivery ready, transactional.id \"%s\" and \"%s\", progress topic \"%s\"",
						producer->transactional_id,
						producer->alternate->transactional_id,
						producer->progress_topic)));
		return true;
	}
	outbox_producer_destroy(producer);
	producer = NULL;
	if (start == OUTBOX_EOS_UNAVAILABLE)
	{
		outbox_status_set_error(*error);
		outbox_enter_state(OUTBOX_STATE_BROKER_DOWN, *error);
		return false;
	}
	enter_config_error("deliver exactly once", *error,
					   "Fix the progress topic or outbox.progress_topic, or transaction.timeout.ms in outbox.kafka_properties (at least outbox.delivery_timeout, at most the broker's transaction.max.timeout.ms), or set outbox.delivery = at_least_once; then reload the configuration.");
	return false;
}

/*
 * Apply a SIGHUP.  Called between batches, so the batch in flight has
 * finished.  A change to anything the producer was built with replaces the
 * producer; everything else takes effect at the next batch.
 */
static void
reload_config(void)
{
	ConfigReloadPending = false;
	outbox_reload_config_file();

	if (producer != NULL && outbox_producer_settings_changed(producer))
	{
		ereport(LOG,
				(errmsg("outbox relay: Kafka settings changed, reconnecting")));
		outbox_producer_destroy(producer);
		producer = NULL;
	}
}

/*
 * on_proc_exit callback: drop the producer so that librdkafka's threads end
 * before the process does.  Purging first keeps this fast when no broker is
 * reachable (pg_ctl stop -m fast).
 */
static void
destroy_producer_at_exit(int code, Datum arg)
{
	if (producer != NULL)
	{
		outbox_producer_destroy(producer);
		producer = NULL;
	}
}
