/*-------------------------------------------------------------------------
 *
 * inbox_launcher.c
 *	  The inbox launcher of a database: reads its subscriptions and keeps
 *	  their inbox workers running.
 *
 * The launcher (launcher/launcher_inbox.c) starts one per covered
 * database, in one of the outbox.max_workers slots the relays use.  It
 * exits at once, with code 0, when the database has no subscription (or
 * no extension): the launcher then starts none there until
 * outbox.subscribe() commits.
 *
 * Each subscription gets its own inbox workers (inbox_worker.c), so a slow
 * or failing handler holds only its own subscription: an active one
 * outbox.inbox_workers_per_subscription (k), each applying one slice of
 * its partitions (a partition's slice is fixed by its topic and number,
 * inbox_partition_slice()), a paused one or a restored copy one, which
 * applies nothing and shows its partitions.  When k changes, or a
 * subscription is paused or resumed, the workers of the old split are all
 * stopped before those of the new one start, so no two workers ever
 * apply one partition at once (the offsets' compare-and-set would roll
 * one back anyway).  A worker that exits while it is still wanted is
 * started again after a delay that doubles up to a minute.  Workers come
 * from a pool of outbox.inbox_max_workers (shared memory) and from
 * max_worker_processes; when either is used up, the subscription shows
 * waiting_for_worker until one frees.
 *
 * SIGTERM (the launcher, or a fast shutdown) ends it; its workers are
 * stopped as it exits.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "inbox/inbox.h"
#include "config/guc_refusal.h"
#include "shared/bgworker.h"
#include "shared/shmem.h"

#include "access/xact.h"
#include "catalog/namespace.h"
#include "commands/extension.h"
#include "common/hashfn.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "pgstat.h"
#include "postmaster/bgworker.h"
#include "postmaster/interrupt.h"
#include "storage/ipc.h"
#include "storage/latch.h"
#include "tcop/tcopprot.h"
#include "utils/builtins.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"

/* the subscriptions are read again this often, even without a commit (ms) */
#define REREAD_MS				10000
/* longest sleep between two passes (ms) */
#define NAP_MS					1000
/* delay before a worker that exited is started again, doubling (ms) */
#define BACKOFF_MIN_MS			1000
#define BACKOFF_MAX_MS			60000
/* a worker that ran this long before exiting starts its backoff afresh */
#define STABLE_MS				60000

/* one inbox worker this launcher runs or wants */
typedef struct Launched
{
	char		subscription[NAMEDATALEN];
	int			slice;
	int			nslices;
	int			entry;			/* pool entry, or -1 */
	uint32		generation;		/* of its claim */
	BackgroundWorkerHandle *handle; /* NULL: not running */
	bool		stopping;		/* asked to exit */
	bool		wanted;			/* in the latest reading */
	int			failures;
	TimestampTz started_at;
	TimestampTz start_after;
} Launched;

static List *launched = NIL;	/* of Launched, in TopMemoryContext */
static const char *launcher_database = NULL;
static uint32 read_seq = 0;
static TimestampTz last_read = 0;

pg_noreturn static void launcher_loop(void);
static bool read_subscriptions(List **wanted);
static void reconcile(List *wanted, TimestampTz now, long *nap);
static void reap(Launched *w, TimestampTz now);
static bool start_worker(Launched *w, char **error);
static void stop_worker(Launched *w);
static void stop_all_at_exit(int code, Datum arg);
static void exit_idle(const char *why);

/*
 * outbox_inbox_main
 *		Entry point of an inbox launcher, started by the launcher; main_arg
 *		is its slot in shared memory, bgw_extra an InboxArgs naming the
 *		database.  Never returns (see the file header).
 */
void
outbox_inbox_main(Datum main_arg)
{
	InboxArgs	args;
	List	   *wanted = NIL;

	pqsignal(SIGHUP, SignalHandlerForConfigReload);
	pqsignal(SIGTERM, die);
	BackgroundWorkerUnblockSignals();

	memcpy(&args, MyBgworkerEntry->bgw_extra, sizeof(args));
	launcher_database = MemoryContextStrdup(TopMemoryContext, args.dbname);
	BackgroundWorkerInitializeConnectionByOid(args.dboid, InvalidOid, 0);
	SetConfigOption("search_path", "pg_catalog, pg_temp", PGC_SUSET, PGC_S_OVERRIDE);
	SetConfigOption("statement_timeout", "0", PGC_SUSET, PGC_S_OVERRIDE);
	outbox_disable_transaction_timeout();

	inbox_shmem_register(DatumGetInt32(main_arg));
	on_proc_exit(stop_all_at_exit, (Datum) 0);
	outbox_reload_config_file();

	read_seq = inbox_shmem_control_seq();
	if (!read_subscriptions(&wanted) && inbox_shmem_note_no_subscriptions(read_seq))
	{
		ereport(DEBUG1,
				(errmsg("outbox inbox launcher for database \"%s\" exits: no subscription",
						launcher_database)));
		proc_exit(0);
	}
	inbox_shmem_note_serving();
	ereport(LOG,
			(errmsg("outbox inbox launcher started for database \"%s\"",
					launcher_database)));
	launcher_loop();
}

static void
launcher_loop(void)
{
	for (;;)
	{
		TimestampTz now;
		long		nap = NAP_MS;
		ListCell   *lc;

		CHECK_FOR_INTERRUPTS();
		if (ConfigReloadPending)
		{
			ConfigReloadPending = false;
			outbox_reload_config_file();
			last_read = 0;
		}
		now = GetCurrentTimestamp();
		foreach(lc, launched)
			reap(lfirst(lc), now);
		if (inbox_shmem_control_seq() != read_seq || last_read == 0 ||
			TimestampDifferenceExceeds(last_read, now, REREAD_MS))
		{
			List	   *wanted = NIL;

			read_seq = inbox_shmem_control_seq();
			last_read = now;
			if (!read_subscriptions(&wanted))
			{
				/* returns when a subscription came while it stopped */
				exit_idle("no subscription left");
				last_read = 0;
				continue;
			}
			reconcile(wanted, now, &nap);
			list_free_deep(wanted);
		}
		else
			reconcile(NIL, now, &nap);

		(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
						 nap, outbox_wait_event(OUTBOX_WAIT_IDLE));
		ResetLatch(MyLatch);
	}
}

/*
 * Read which workers the subscriptions want, into *wanted (a List of
 * palloc'd Launched, in TopMemoryContext); false when the database has no
 * subscription or no extension (at 1.8 or later).  Its own transaction.
 */
static bool
read_subscriptions(List **wanted)
{
	bool		any = false;
	int			k = outbox_inbox_workers_per_subscription;

	SetCurrentStatementStartTimestamp();
	StartTransactionCommand();
	PushActiveSnapshot(GetTransactionSnapshot());
	if (OidIsValid(get_extension_oid(OUTBOX_EXTENSION_NAME, true)) &&
		OidIsValid(get_relname_relid("subscriptions",
									 get_namespace_oid(OUTBOX_SCHEMA, true))))
	{
		uint64		i;

		if (SPI_connect() != SPI_OK_CONNECT)
			elog(ERROR, "SPI_connect failed");
		if (SPI_execute("SELECT s.name, s.paused"
						"       OR s.system_identifier <> (SELECT c.system_identifier FROM pg_catalog.pg_control_system() AS c)"
						"       OR (s.database_oid <> (SELECT d.oid FROM pg_catalog.pg_database AS d"
						"                               WHERE d.datname = pg_catalog.current_database())"
						"           AND s.database_name <> pg_catalog.current_database())"
						"  FROM outbox.subscriptions AS s ORDER BY s.name", true, 0) != SPI_OK_SELECT)
			elog(ERROR, "outbox inbox launcher: reading the subscriptions failed");
		any = SPI_processed > 0;
		for (i = 0; i < SPI_processed; i++)
		{
			bool		isnull;
			char	   *name = TextDatumGetCString(SPI_getbinval(SPI_tuptable->vals[i],
																 SPI_tuptable->tupdesc, 1, &isnull));
			bool		idle = DatumGetBool(SPI_getbinval(SPI_tuptable->vals[i],
														  SPI_tuptable->tupdesc, 2, &isnull));
			int			n = idle ? 1 : k;
			int			s;

			for (s = 0; s < n; s++)
			{
				MemoryContext old = MemoryContextSwitchTo(TopMemoryContext);
				Launched   *w = palloc0(sizeof(Launched));

				strlcpy(w->subscription, name, NAMEDATALEN);
				w->slice = s;
				w->nslices = n;
				/* the list outlives SPI's memory */
				*wanted = lappend(*wanted, w);
				MemoryContextSwitchTo(old);
			}
		}
		SPI_finish();
	}
	PopActiveSnapshot();
	CommitTransactionCommand();
	return any;
}

/* the entry of launched for (subscription, slice, nslices), or NULL */
static Launched *
find_launched(const char *subscription, int slice, int nslices)
{
	ListCell   *lc;

	foreach(lc, launched)
	{
		Launched   *w = lfirst(lc);

		if (w->slice == slice && w->nslices == nslices &&
			strcmp(w->subscription, subscription) == 0)
			return w;
	}
	return NULL;
}

/* does a worker of subscription with another split than nslices still run? */
static bool
other_split_runs(const char *subscription, int nslices)
{
	ListCell   *lc;

	foreach(lc, launched)
	{
		Launched   *w = lfirst(lc);

		if (w->handle != NULL && w->nslices != nslices &&
			strcmp(w->subscription, subscription) == 0)
			return true;
	}
	return false;
}

/*
 * Make the workers match wanted (NIL: keep the last reading): stop those
 * no longer wanted, start the missing ones whose delay passed and whose
 * subscription's old split has exited.  Shows waiting_for_worker when one
 * could not start.  Lowers *nap (ms).
 */
static void
reconcile(List *wanted, TimestampTz now, long *nap)
{
	ListCell   *lc;
	char	   *waiting = NULL;

	if (wanted != NIL)
	{
		foreach(lc, launched)
			((Launched *) lfirst(lc))->wanted = false;
		foreach(lc, wanted)
		{
			Launched   *want = lfirst(lc);
			Launched   *w = find_launched(want->subscription, want->slice, want->nslices);

			if (w == NULL)
			{
				MemoryContext old = MemoryContextSwitchTo(TopMemoryContext);

				w = palloc0(sizeof(Launched));
				memcpy(w, want, sizeof(Launched));
				w->entry = -1;
				launched = lappend(launched, w);
				MemoryContextSwitchTo(old);
			}
			w->wanted = true;
		}
	}
	foreach(lc, launched)
	{
		Launched   *w = lfirst(lc);

		if (!w->wanted)
			stop_worker(w);
	}
	foreach(lc, launched)
	{
		Launched   *w = lfirst(lc);
		char	   *error = NULL;

		if (!w->wanted || w->handle != NULL)
			continue;
		if (other_split_runs(w->subscription, w->nslices))
		{
			*nap = Min(*nap, 100);
			continue;
		}
		if (w->start_after > now)
		{
			*nap = Min(*nap, Max(TimestampDifferenceMilliseconds(now, w->start_after), 10));
			continue;
		}
		if (!start_worker(w, &error))
		{
			waiting = error;
			*nap = Min(*nap, 1000);
		}
	}
	/* forget what is neither wanted nor running */
	foreach(lc, launched)
	{
		Launched   *w = lfirst(lc);

		if (!w->wanted && w->handle == NULL)
		{
			inbox_worker_release(w->entry, w->generation);
			launched = foreach_delete_current(launched, lc);
			pfree(w);
		}
	}
	if (waiting != NULL)
		inbox_launcher_set_state(INBOX_STATE_WAITING_FOR_WORKER, waiting);
	else
		inbox_launcher_set_state(INBOX_STATE_RUNNING, NULL);
}

/* forget w's worker if it exited; one still wanted starts again later */
static void
reap(Launched *w, TimestampTz now)
{
	pid_t		pid;
	int			delay;

	if (w->handle == NULL)
		return;
	switch (GetBackgroundWorkerPid(w->handle, &pid))
	{
		case BGWH_STOPPED:
			break;
		case BGWH_POSTMASTER_DIED:
			proc_exit(1);
			break;
		default:
			return;
	}
	pfree(w->handle);
	w->handle = NULL;
	inbox_worker_release(w->entry, w->generation);
	w->entry = -1;
	if (!w->stopping)
	{
		if (TimestampDifferenceExceeds(w->started_at, now, STABLE_MS))
			w->failures = 0;
		delay = Min(BACKOFF_MIN_MS << Min(w->failures, 6), BACKOFF_MAX_MS);
		w->failures++;
		w->start_after = TimestampTzPlusMilliseconds(now, delay);
		/* the subscription may be gone: read again before starting it */
		last_read = 0;
	}
	w->stopping = false;
}

/*
 * Start w's worker: a pool entry, then a dynamic background worker.  False
 * with *error set (the entry kept, showing waiting_for_worker) when either
 * is used up.
 */
static bool
start_worker(Launched *w, char **error)
{
	BackgroundWorker bgw;
	InboxWorkerArgs args;
	bool		registered;
	MemoryContext old;

	if (w->entry < 0)
		w->entry = inbox_worker_claim(MyDatabaseId, w->subscription, w->slice,
										w->nslices, &w->generation);
	if (w->entry < 0)
	{
		*error = psprintf("subscription \"%s\" waits for an inbox worker: all outbox.inbox_max_workers (%d) are in use",
						  w->subscription, inbox_shmem_nworkers());
		return false;
	}
	memset(&args, 0, sizeof(args));
	args.dboid = MyDatabaseId;
	args.launcher_slot = inbox_my_slot;
	args.slice = w->slice;
	args.nslices = w->nslices;
	args.generation = w->generation;
	strlcpy(args.subscription, w->subscription, NAMEDATALEN);
	outbox_init_bgworker(&bgw, "outbox_inbox_worker_main", "outbox inbox", BGW_NEVER_RESTART);
	snprintf(bgw.bgw_name, BGW_MAXLEN, "outbox inbox for subscription \"%s\" (%d of %d)",
			 w->subscription, w->slice + 1, w->nslices);
	bgw.bgw_main_arg = Int32GetDatum(w->entry);
	bgw.bgw_notify_pid = MyProcPid;
	StaticAssertStmt(sizeof(InboxWorkerArgs) <= BGW_EXTRALEN,
					 "InboxWorkerArgs does not fit in bgw_extra");
	memcpy(bgw.bgw_extra, &args, sizeof(args));
	old = MemoryContextSwitchTo(TopMemoryContext);
	registered = RegisterDynamicBackgroundWorker(&bgw, &w->handle);
	MemoryContextSwitchTo(old);
	if (!registered)
	{
		w->handle = NULL;
		*error = psprintf("subscription \"%s\" waits for an inbox worker: max_worker_processes (%d) are all in use",
						  w->subscription, max_worker_processes);
		inbox_worker_set_waiting(w->entry, *error);
		return false;
	}
	w->started_at = GetCurrentTimestamp();
	w->stopping = false;
	return true;
}

/* ask w's worker to exit (SIGTERM through the postmaster) */
static void
stop_worker(Launched *w)
{
	if (w->handle == NULL || w->stopping)
		return;
	TerminateBackgroundWorker(w->handle);
	w->stopping = true;
}

/*
 * Stop every worker, wait until they have exited (each ends at its next
 * CHECK_FOR_INTERRUPTS), then exit with code 0 and tell the launcher that
 * the database has nothing to consume; return instead when a control
 * commit (a subscribe()) came since the subscriptions were read.
 */
static void
exit_idle(const char *why)
{
	ListCell   *lc;

	foreach(lc, launched)
		stop_worker(lfirst(lc));
	for (;;)
	{
		bool		running = false;
		TimestampTz now = GetCurrentTimestamp();

		foreach(lc, launched)
		{
			reap(lfirst(lc), now);
			if (((Launched *) lfirst(lc))->handle != NULL)
				running = true;
		}
		if (!running)
			break;
		CHECK_FOR_INTERRUPTS();
		(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
						 100, outbox_wait_event(OUTBOX_WAIT_IDLE));
		ResetLatch(MyLatch);
	}
	if (!inbox_shmem_note_no_subscriptions(read_seq))
		return;
	ereport(LOG,
			(errmsg("outbox inbox launcher for database \"%s\" exits: %s",
					launcher_database, why)));
	proc_exit(0);
}

/*
 * on_proc_exit: stop the workers, so that none outlives its launcher (they
 * would keep the database busy with nobody to watch them); each frees its
 * pool entry as it exits, those that never started are freed here.
 * Raises no error; does not wait.
 */
static void
stop_all_at_exit(int code, Datum arg)
{
	ListCell   *lc;

	foreach(lc, launched)
	{
		Launched   *w = lfirst(lc);

		if (w->handle != NULL)
			TerminateBackgroundWorker(w->handle);
		else if (w->entry >= 0)
			inbox_worker_release(w->entry, w->generation);
	}
}

/*
 * inbox_partition_slice
 *		Which of nslices workers applies (topic, partition): fixed by the
 *		names, the same in every process, so that each partition has one
 *		worker of its subscription.
 */
int
inbox_partition_slice(const char *topic, int32 partition, int nslices)
{
	uint32		h;

	if (nslices <= 1)
		return 0;
	h = hash_bytes((const unsigned char *) topic, strlen(topic));
	return (int) ((h + (uint32) partition) % (uint32) nslices);
}
