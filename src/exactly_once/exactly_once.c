/*-------------------------------------------------------------------------
 *
 * exactly_once.c
 *	  outbox.delivery = exactly_once: each relay transaction is one Kafka
 *	  transaction that also carries a progress record, and after any
 *	  crash the relay reads the last committed record back before it sends
 *	  anything.
 *
 * Why this is exactly-once for read_committed consumers:
 *	- A batch's events and its progress record are committed to Kafka
 *	  together, or aborted together (consumers never see aborted ones).
 *	- The database records the same progress only after the Kafka commit.
 *	  The one window left is a crash between the two commits: Kafka has the
 *	  batch, the database does not know.  The record tells: it holds the
 *	  database's progress before the batch ("before") and after it
 *	  ("after"), or, for events tracked row by row, their ids.
 *	- On start (and after any error or fatal producer error, which rebuilds
 *	  the producer) the relay calls rd_kafka_init_transactions(), which
 *	  aborts what an earlier incarnation left open and fences it; commits a
 *	  sentinel and reads the progress topic back to it (progress_log.c); and
 *	  if the database still has "before", records "after" (or marks the
 *	  rows published) in the database.  Then it goes on, and the next batch
 *	  starts exactly where the committed one ended.
 *	- A database that is ahead of the record (batches without events are
 *	  not written to Kafka, or a stretch of at_least_once) is left as it is.
 *	  One that is neither "before", "after" nor ahead (restored from a
 *	  backup, say) is left too, with a WARNING: events after its progress
 *	  may be sent again, never skipped.  A record written for an earlier
 *	  outbox.events (DROP and CREATE EXTENSION since) is ignored: ids
 *	  start over, and it would mark events Kafka never got.
 *
 * The transactional.id is "outbox-<system identifier>-<database oid>" for
 * relay 1 of the database, and that with "-w<n>" for relay n of
 * outbox.workers_per_database = k > 1: the same after a restart, after a
 * change of k, and on a promoted standby, so that an old primary, or a
 * relay of an earlier k that still runs, is fenced at its next Kafka call.
 * Each relay writes its records under its own id.  Events of one bucket
 * move to another relay when k changes, and a relay that is gone (k was
 * lowered) no longer reads its own record back: so at its start each relay
 * also reads the last record of every other relay of its database, and
 * marks what those say Kafka committed (rows records only: the snapshot
 * batches, and their records, are relay 1's).  The read for others' keys
 * covers the offsets read for its own (at least the last 1000 of the
 * progress topic), where the record of a relay that ended with k is.
 *
 * Two transactional producers take turns, the second with that id and
 * "-alt": after a commit, Kafka refuses the same id's next transaction
 * (CONCURRENT_TRANSACTIONS) until it wrote the commit markers, a few ms,
 * and librdkafka 2.0 then waits a fixed 20 ms before it asks again.  The
 * other id starts the next batch at once.  Order holds because a batch is
 * produced only after the one before it was committed.  Both write their
 * records under the first id, so the last record is the last batch.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "exactly_once/exactly_once.h"
#include "config/guc.h"
#include "exactly_once/progress_log.h"
#include "exactly_once/txn.h"
#include "kafka/producer.h"
#include "relay/fault_point.h"
#include "relay/mark.h"
#include "relay/message.h"
#include "relay/relay.h"
#include "relay/relay_xact.h"
#include "shared/partition.h"

#include "access/xlog.h"
#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "pgstat.h"
#include "utils/builtins.h"
#include "utils/memutils.h"

/* ms the start may wait for each of init, topic check and read-back */
#define START_TIMEOUT_MS	30000
/* ms a commit or an abort may take */
#define COMMIT_TIMEOUT_MS	10000

static const char *const adopt_snapshot_sql =
"UPDATE outbox.relay_progress AS p"
"   SET snapshot = (k.a->>0)::pg_catalog.pg_snapshot, id_floor = (k.a->>1)::pg_catalog.int8,"
"       batch_snapshot = (k.a->>2)::pg_catalog.pg_snapshot,"
"       batch_id_floor = (k.a->>3)::pg_catalog.int8, batch_last_id = (k.a->>4)::pg_catalog.int8"
"  FROM (SELECT $1::pg_catalog.jsonb -> 'before' AS b, $1::pg_catalog.jsonb -> 'after' AS a) AS k"
" WHERE COALESCE(p.snapshot::text, '1:1:') = k.b->>0"
"   AND p.id_floor = (k.b->>1)::pg_catalog.int8"
"   AND p.batch_snapshot::text IS NOT DISTINCT FROM k.b->>2"
"   AND p.batch_id_floor IS NOT DISTINCT FROM (k.b->>3)::pg_catalog.int8"
"   AND p.batch_last_id IS NOT DISTINCT FROM (k.b->>4)::pg_catalog.int8";

static const char *const demote_sql =
"UPDATE outbox.events AS e SET xid = NULL"
"  FROM pg_catalog.jsonb_array_elements_text($1::pg_catalog.jsonb -> 'demote') AS d(id)"
" WHERE e.id = d.id::pg_catalog.int8 AND e.xid IS NOT NULL";

/* is the database's progress the record's "after" (1), ahead of it (2)? */
static const char *const compare_snapshot_sql =
"SELECT CASE WHEN COALESCE(p.snapshot::text, '1:1:') = k.a->>0"
"             AND p.id_floor = (k.a->>1)::pg_catalog.int8"
"             AND p.batch_snapshot::text IS NOT DISTINCT FROM k.a->>2"
"             AND p.batch_last_id IS NOT DISTINCT FROM (k.a->>4)::pg_catalog.int8 THEN 1"
"            WHEN pg_catalog.pg_snapshot_xmax(COALESCE(p.batch_snapshot, p.snapshot, '1:1:'))"
"                 >= pg_catalog.pg_snapshot_xmax(COALESCE(k.a->>2, k.a->>0)::pg_catalog.pg_snapshot) THEN 2"
"            ELSE 0 END"
"  FROM outbox.relay_progress AS p,"
"       (SELECT $1::pg_catalog.jsonb -> 'after' AS a) AS k";

/*
 * Row-tracked events: each as [id, ctid as claimed].  Only a row still in
 * the version the relay claimed is marked: one marked and then replayed
 * (outbox.replay() writes a new version) must be sent again.
 */
static const char *const adopt_rows_sql[2] = {
	"UPDATE outbox.events AS e SET published_at = pg_catalog.now()"
	"  FROM pg_catalog.jsonb_array_elements($1::pg_catalog.jsonb -> 'rows') AS r(v)"
	" WHERE e.id = (r.v->>0)::pg_catalog.int8 AND e.ctid = (r.v->>1)::pg_catalog.tid"
	"   AND e.published_at IS NULL",
	/* outbox.retention = 0 */
	"DELETE FROM outbox.events AS e"
	" USING pg_catalog.jsonb_array_elements($1::pg_catalog.jsonb -> 'rows') AS r(v)"
	" WHERE e.id = (r.v->>0)::pg_catalog.int8 AND e.ctid = (r.v->>1)::pg_catalog.tid"
	"   AND e.published_at IS NULL"
};

/*
 * The key of this relay's progress records and sentinels: its first
 * transactional.id.  Every relay of the database has "<database_key>" or
 * "<database_key>-w<n>".
 */
static char *progress_key = NULL;
static char *database_key = NULL;

static OutboxTxnOutcome init_alternate(OutboxProducer *producer, char **error);
static bool record_for_table(const char *record, Oid relid);
static void reconcile(const char *record, bool own);
static void reconcile_all(OutboxProgressRecords *records);
static void reconcile_snapshot(const char *record);
static void reconcile_rows(const char *record);

/*
 * outbox_eos_transactional_id
 *		"outbox-<system identifier>-<database oid>" for relay 1 of the
 *		database, with "-w<n>" for relay n > 1 (palloc'd).
 */
char *
outbox_eos_transactional_id(void)
{
	char	   *id = psprintf("outbox-" UINT64_FORMAT "-%u", GetSystemIdentifier(),
							  MyDatabaseId);

	if (outbox_relay_worker == 0)
		return id;
	return psprintf("%s-w%d", id, outbox_relay_worker + 1);
}

/*
 * outbox_eos_start
 *		Make a new transactional producer and its alternate (built here)
 *		ready: initialize the transactions of both, check the progress
 *		topic (progress_topic_check), read the last progress record back
 *		and bring the database in line with it (reconcile, in a
 *		transaction of its own).  *error (palloc'd) says
 *		why it is not ready.  Raises ERROR if the database statements fail.
 */
OutboxEosStart
outbox_eos_start(OutboxProducer *producer, char **error)
{
	OutboxTxnOutcome outcome;
	bool		unavailable = false;
	OutboxProgressRecords records;

	if (progress_key == NULL)
	{
		progress_key = MemoryContextStrdup(TopMemoryContext,
										   outbox_eos_transactional_id());
		database_key = MemoryContextStrdup(TopMemoryContext,
										   psprintf("outbox-" UINT64_FORMAT "-%u",
													GetSystemIdentifier(),
													MyDatabaseId));
	}
	pgstat_report_activity(STATE_RUNNING, "outbox relay: initializing Kafka transactions");
	outcome = init_alternate(producer, error);
	if (outcome == OUTBOX_TXN_OK)
		outcome = outbox_txn_init(producer, START_TIMEOUT_MS, error);
	if (outcome == OUTBOX_TXN_FATAL)
		return OUTBOX_EOS_REFUSED;
	if (outcome != OUTBOX_TXN_OK)
		return OUTBOX_EOS_UNAVAILABLE;

	*error = outbox_progress_topic_check(producer, producer->progress_topic,
										 START_TIMEOUT_MS, &unavailable);
	if (*error != NULL)
		return unavailable ? OUTBOX_EOS_UNAVAILABLE : OUTBOX_EOS_REFUSED;

	pgstat_report_activity(STATE_RUNNING, "outbox relay: reading its progress back from Kafka");
	memset(&records, 0, sizeof(records));
	records.database_key = database_key;
	records.self = outbox_relay_worker;
	if (!outbox_progress_read_back(producer, producer->progress_topic,
								   progress_key, START_TIMEOUT_MS, &records,
								   error))
		return OUTBOX_EOS_UNAVAILABLE;
	pgstat_report_activity(STATE_IDLE, NULL);
	reconcile_all(&records);
	return OUTBOX_EOS_READY;
}

/*
 * Build the second producer ("<transactional.id>-alt") and initialize its
 * transactions, before the first's: the read-back must not start while a
 * transaction an earlier incarnation left open under either id could
 * still commit.
 */
static OutboxTxnOutcome
init_alternate(OutboxProducer *producer, char **error)
{
	char	   *id = psprintf("%s-alt", producer->transactional_id);

	Assert(producer->alternate == NULL);
	producer->alternate = outbox_producer_create(id, error);
	pfree(id);
	if (producer->alternate == NULL)
		return OUTBOX_TXN_FATAL;
	return outbox_txn_init(producer->alternate, START_TIMEOUT_MS, error);
}

/*
 * outbox_eos_alternate
 *		The producer for the next batch: producer's alternate, which takes
 *		producer as its own.  producer itself when it has none (at_least_once).
 */
OutboxProducer *
outbox_eos_alternate(OutboxProducer *producer)
{
	OutboxProducer *next = producer->alternate;

	if (next == NULL)
		return producer;
	producer->alternate = NULL;
	next->alternate = producer;
	return next;
}

/*
 * Was record written for the outbox.events whose OID is relid?  After DROP
 * and CREATE EXTENSION the table is new, its ids and ctids start over, and
 * a record of the old one would mark events published that Kafka never got.
 * A record without the field (written before it existed) is taken as is.
 */
static bool
record_for_table(const char *record, Oid relid)
{
	const char *field = strstr(record, "\"events_table\": ");

	if (field == NULL)
		return true;
	return strtoul(field + strlen("\"events_table\": "), NULL, 10) == relid;
}

/*
 * Bring the database in line with the last committed progress record: this
 * relay's own (own), or another relay's of the database, of which only a
 * rows record counts (see the head comment).
 */
static void
reconcile(const char *record, bool own)
{
	MemoryContext callercxt = outbox_relay_xact_begin("outbox relay: reconciling its progress with Kafka");
	Oid			relid = outbox_lock_events_table();

	if (!OidIsValid(relid))
		;						/* no extension: nothing to bring in line */
	else if (!record_for_table(record, relid))
	{
		if (own)
			ereport(LOG,
					(errmsg("outbox relay: the last progress record in Kafka was written for an earlier outbox.events; ignored"),
					 errdetail("The extension was dropped and created again since: event ids and row positions start over, so the record says nothing about today's events.")));
	}
	else if (strncmp(record, "{\"kind\": \"snapshot\"", 19) == 0)
	{
		/* relay 1 alone runs the snapshot batches and reads their records */
		if (own)
			reconcile_snapshot(record);
	}
	else if (strncmp(record, "{\"kind\": \"rows\"", 15) == 0)
		reconcile_rows(record);
	else if (own)
		ereport(WARNING,
				(errmsg("outbox relay: the last record under its transactional.id in the progress topic is not a progress record; ignored"),
				 errdetail("Record: %.200s", record)));
	outbox_relay_xact_end(callercxt, false);
}

/*
 * The last records of the database's relays read back (records->records[n]
 * of relay n + 1), this relay's own first, each in a transaction of its own.
 */
static void
reconcile_all(OutboxProgressRecords *records)
{
	if (records->records[records->self] != NULL)
		reconcile(records->records[records->self], true);
	for (int n = 0; n < OUTBOX_MAX_WORKERS_PER_DATABASE; n++)
	{
		if (records->records[n] != NULL && n != records->self)
			reconcile(records->records[n], false);
	}
}

static void
reconcile_snapshot(const char *record)
{
	Oid			types[1] = {TEXTOID};
	Datum		args[1] = {CStringGetTextDatum(record)};
	char	   *verdict;

	if (SPI_execute_with_args(adopt_snapshot_sql, 1, types, args, NULL, false, 0) != SPI_OK_UPDATE)
		elog(ERROR, "outbox: could not record the progress read back from Kafka");
	if (SPI_processed == 1)
	{
		/* the batch's held-back events go to row tracking with it */
		if (SPI_execute_with_args(demote_sql, 1, types, args, NULL, false, 0) != SPI_OK_UPDATE)
			elog(ERROR, "outbox: could not hand the held-back events of the progress read back to row tracking");
		ereport(LOG,
				(errmsg("outbox relay: the last batch was committed to Kafka but not recorded in the database; recorded it now"),
				 errdetail("Nothing of it is sent again (outbox.delivery = exactly_once).")));
		return;
	}
	if (SPI_execute_with_args(compare_snapshot_sql, 1, types, args, NULL, true, 1) != SPI_OK_SELECT ||
		SPI_processed != 1)
		elog(ERROR, "outbox: outbox.relay_progress does not have one row");
	verdict = SPI_getvalue(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1);
	if (strcmp(verdict, "0") == 0)
		ereport(WARNING,
				(errmsg("outbox relay: the database's progress is behind the last progress record in Kafka, and not where that batch began"),
				 errdetail("The database may have been restored from a backup. The relay goes on from the database's progress: events after it may be sent again, none is skipped."),
				 errhint("Record: %.300s", record)));
	else
		elog(DEBUG1, "outbox relay: progress in Kafka and in the database agree (%s)", verdict);
}

static void
reconcile_rows(const char *record)
{
	Oid			types[1] = {TEXTOID};
	Datum		args[1] = {CStringGetTextDatum(record)};
	int			ret;

	ret = SPI_execute_with_args(adopt_rows_sql[outbox_retention == 0], 1, types, args,
								NULL, false, 0);
	if (ret != SPI_OK_UPDATE && ret != SPI_OK_DELETE)
		elog(ERROR, "outbox: could not mark the events read back from Kafka published");
	if (SPI_processed > 0)
		ereport(LOG,
				(errmsg("outbox relay: %llu event(s) were committed to Kafka but not marked published; marked them now",
						(unsigned long long) SPI_processed),
				 errdetail("None of them is sent again (outbox.delivery = exactly_once).")));
}

/*
 * outbox_eos_begin
 *		rd_kafka_begin_transaction() for a batch.  False (result->aborted
 *		set, or result->fatal) when the batch must not be produced.
 */
bool
outbox_eos_begin(OutboxProducer *producer, OutboxBatchResult *result)
{
	char	   *error;

	if (outbox_txn_begin(producer, &error) == OUTBOX_TXN_OK)
		return true;
	result->aborted = true;
	result->fatal = producer->fatal = true;
	result->first_error = MemoryContextStrdup(result->cxt, error);
	return false;
}

/*
 * outbox_eos_add_record
 *		Produce the progress record into the batch's transaction, as
 *		deliveries[index], right after the batch's events: its report is
 *		awaited with theirs, so that the commit costs one round trip more,
 *		not two.  If any event then fails, the transaction (record included)
 *		is aborted.  A full local queue is waited out as for the events
 *		(outbox_send_with_backpressure).  False if it could not be produced
 *		(SIGTERM while the queue was full, a refusal): the batch is then
 *		aborted, never committed without its record.
 */
bool
outbox_eos_add_record(OutboxProducer *producer, const char *record, int index)
{
	OutboxMessage msg;

	memset(&msg, 0, sizeof(msg));
	msg.topic = producer->progress_topic;
	msg.key = progress_key;
	msg.key_len = strlen(msg.key);
	msg.value = record;
	msg.value_len = strlen(record);
	/* with the events' backpressure: a full queue is no reason to abort */
	return outbox_send_with_backpressure(producer, index, &msg) == RD_KAFKA_RESP_ERR_NO_ERROR;
}

/*
 * outbox_eos_commit
 *		Commit the batch's transaction once Kafka acknowledged its events and
 *		its progress record (deliveries[index]).  True if Kafka committed.
 *		Else the transaction was aborted (result->aborted), or the producer
 *		is to be rebuilt (result->fatal), also when it is not known whether
 *		the commit went through: the rebuild reads the progress back.
 */
bool
outbox_eos_commit(OutboxProducer *producer, int index, OutboxBatchResult *result)
{
	char	   *error = NULL;
	OutboxTxnOutcome outcome;

	if (!producer->deliveries[index].reported ||
		producer->deliveries[index].err != RD_KAFKA_RESP_ERR_NO_ERROR)
	{
		outbox_eos_abort(producer, result);
		return false;
	}
	outbox_fault_point("mid_transaction");
	outcome = outbox_txn_commit(producer, COMMIT_TIMEOUT_MS, &error);
	if (outcome == OUTBOX_TXN_OK)
	{
		outbox_fault_point("after_kafka_commit");
		return true;
	}
	if (result->first_error == NULL)
		result->first_error = MemoryContextStrdup(result->cxt, error);
	if (outcome == OUTBOX_TXN_ABORTABLE)
		outbox_eos_abort(producer, result);
	else
		producer->fatal = true;
	result->aborted = true;
	result->fatal = producer->fatal;
	return false;
}

/*
 * outbox_eos_abort
 *		Abort the batch's transaction.  If even that fails, the producer is
 *		rebuilt (result->fatal): rd_kafka_init_transactions() aborts it.
 */
void
outbox_eos_abort(OutboxProducer *producer, OutboxBatchResult *result)
{
	char	   *error = NULL;

	if (!producer->fatal &&
		outbox_txn_abort(producer, COMMIT_TIMEOUT_MS, &error) != OUTBOX_TXN_OK)
		producer->fatal = true;
	if (error != NULL && result->first_error == NULL)
		result->first_error = MemoryContextStrdup(result->cxt, error);
	result->aborted = true;
	result->fatal = producer->fatal;
}

/*
 * outbox_eos_keep_refusals
 *		After an abort, nothing of entries[0..n-1] (producer->deliveries) is
 *		published, and only an event that Kafka refused for good (too large,
 *		say: outbox_kafka_error_is_permanent) failed by itself; the others'
 *		errors (the transaction's error state, purges, timeouts) belong to the
 *		batch.  So every report but the permanent refusals is dropped, and
 *		marking (mark.c) then records only those.  Returns how many remain;
 *		*transient is set if a timeout or an unreachable broker was among the
 *		dropped errors (the relay then counts the broker as down).
 */
int
outbox_eos_keep_refusals(OutboxProducer *producer, BatchEntry *entries, int n,
						 bool *transient)
{
	int			refused = 0;

	*transient = false;
	for (int i = 0; i < n; i++)
	{
		BatchEntry *e = &entries[i];
		OutboxDelivery *d = &producer->deliveries[i];
		rd_kafka_resp_err_t err = e->produced ? d->err : e->error;

		if (!outbox_delivery_failed(e, d) && !(e->produced && d->reported))
			continue;
		if (err != RD_KAFKA_RESP_ERR_NO_ERROR && outbox_kafka_error_is_permanent(err))
		{
			refused++;
			continue;
		}
		if (err == RD_KAFKA_RESP_ERR__MSG_TIMED_OUT || err == RD_KAFKA_RESP_ERR__TIMED_OUT ||
			err == RD_KAFKA_RESP_ERR__TRANSPORT || err == RD_KAFKA_RESP_ERR_REQUEST_TIMED_OUT ||
			err == RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS ||
			err == RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS_AFTER_APPEND)
			*transient = true;
		if (e->produced)
			d->reported = false;
		else
			e->error = RD_KAFKA_RESP_ERR_NO_ERROR;
	}
	return refused;
}
