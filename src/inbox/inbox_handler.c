/*-------------------------------------------------------------------------
 *
 * inbox_handler.c
 *	  What applying events means: calling the subscription's handler (once
 *	  per event, or once per batch for a batch handler), or in queue mode
 *	  inserting the events into outbox.inbox.
 *
 * The handler runs as the role that subscribed, never as the worker's
 * superuser: the worker switches to that role with
 * SECURITY_RESTRICTED_OPERATION (as PostgreSQL 16's logical replication
 * applies changes as the table owner, and maintenance commands run index
 * functions), so the handler, and any trigger it fires, cannot SET ROLE,
 * create temporary objects or leave session state behind.  Settings the
 * handlers change are undone after each batch (a GUC nest level; a worker
 * applies one subscription, so one role), and
 * search_path is "$user", public during the call unless the function sets
 * its own (CREATE FUNCTION ... SET search_path, which is recommended).
 * The worker's own statements keep search_path = pg_catalog, pg_temp.
 *
 * The handler is called through fmgr, not through SQL: EXECUTE is checked
 * here, for the owner, before each batch (outbox.subscribe() checked it for
 * the caller), and outbox.inbox_handler_timeout bounds each call with the
 * statement timeout a client session would have.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "inbox/inbox.h"
#include "config/guc_refusal.h"

#include "catalog/pg_proc.h"
#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "postmaster/interrupt.h"
#include "storage/lock.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/timeout.h"
#include "utils/timestamp.h"

/* the handler of the current batch, looked up in its transaction */
static FmgrInfo handler_flinfo;
static Oid	handler_oid = InvalidOid;
static SPIPlanPtr queue_plan = NULL;
static SPIPlanPtr queue_many_plan = NULL;

/* when the current handler call began; 0 outside a call */
static TimestampTz call_started = 0;

/* a reload happened before a handler call: the worker reads its subscription again */
bool		inbox_config_reloaded = false;

/*
 * the subscription whose handler is running, or NULL: the SQL API refuses to
 * manage it from inside (inbox_subscribe.c)
 */
const char *inbox_applying = NULL;

/*
 * inbox_handler_prepare
 *		Look up sub's handler for the current transaction (call at the start
 *		of each batch, with SPI connected): it must still exist and its
 *		owner must still have EXECUTE on it.  Raises ERROR otherwise; the
 *		worker shows it in outbox.inbox_status and tries again later.
 */
void
inbox_handler_prepare(InboxSubscription *sub)
{
	handler_oid = InvalidOid;
	if (sub->handler_text == NULL)
		return;
	if (!OidIsValid(sub->handler))
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_FUNCTION),
				 errmsg("handler %s of subscription \"%s\" does not exist",
						sub->handler_text, sub->name),
				 errhint("Create the function again, or unsubscribe.")));
	if (outbox_proc_aclcheck(sub->handler, sub->owner, ACL_EXECUTE) != ACLCHECK_OK)
		ereport(ERROR,
				(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
				 errmsg("role \"%s\" of subscription \"%s\" may not execute its handler %s",
						GetUserNameFromId(sub->owner, true) ? GetUserNameFromId(sub->owner, true) : "?",
						sub->name, sub->handler_text),
				 errhint("GRANT EXECUTE on the function to the role.")));
	fmgr_info_cxt(sub->handler, &handler_flinfo, CurTransactionContext);
	handler_oid = sub->handler;
}

/*
 * Queue mode's insert of the events that rows gives, with their keys'
 * rows in outbox.inbox_keys (first_id, pending) in the same statement, in
 * key order (two workers of a subscription never deadlock on them).  A key
 * row a take holds makes it wait: the take then sees these events after it.
 */
#define QUEUE_SQL(rows) \
	"WITH ins AS (" \
	"  INSERT INTO outbox.inbox (subscription, topic, kafka_partition, kafka_offset, key, event_id," \
	"                            event_type, aggregate_type, headers, payload, payload_bytes," \
	"                            kafka_timestamp) " rows \
	"  RETURNING id, subscription, topic, key)" \
	" INSERT INTO outbox.inbox_keys AS k (subscription, topic, key, first_id, pending)" \
	" SELECT subscription, topic, key, pg_catalog.min(id), pg_catalog.count(*) FROM ins" \
	"  WHERE key IS NOT NULL GROUP BY subscription, topic, key ORDER BY topic, key" \
	" ON CONFLICT (subscription, topic, key) DO UPDATE" \
	"   SET first_id = LEAST(k.first_id, EXCLUDED.first_id), pending = k.pending + EXCLUDED.pending"

/*
 * Insert ev into outbox.inbox (queue mode), as the worker.
 */
static void
queue_event(InboxSubscription *sub, const InboxEvent *ev)
{
	Datum		values[12];
	char		nulls[12];
	int			ret;

	if (queue_plan == NULL)
	{
		Oid			types[12] = {TEXTOID, TEXTOID, INT4OID, INT8OID, TEXTOID, UUIDOID,
		TEXTOID, TEXTOID, JSONBOID, JSONBOID, BYTEAOID, TIMESTAMPTZOID};

		queue_plan = SPI_prepare(QUEUE_SQL("VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)"),
								 12, types);
		if (queue_plan == NULL || SPI_keepplan(queue_plan) != 0)
			elog(ERROR, "outbox inbox: could not prepare the queue insert");
	}
	inbox_event_values(ev, sub->name, values, nulls);
	ret = SPI_execute_plan(queue_plan, values, nulls, false, 0);
	if (ret != SPI_OK_INSERT)
		elog(ERROR, "outbox inbox: queueing an event failed: %s",
			 SPI_result_code_string(ret));
}

/* the handler scope entered (inbox_handler_enter), to leave */
static bool in_scope = false;
static Oid	scope_userid;
static int	scope_sec;
static int	scope_nestlevel;

/* a reload that came before a handler call applies to it */
static void
reload_if_pending(void)
{
	if (ConfigReloadPending)
	{
		ConfigReloadPending = false;
		outbox_reload_config_file();
		inbox_config_reloaded = true;
	}
}

/*
 * inbox_handler_enter
 *		Become sub's owner for the handler calls of a batch (see the file
 *		header): SECURITY_RESTRICTED_OPERATION, a GUC nest level, the
 *		handlers' search_path.  Once per batch; inbox_handler_leave() undoes
 *		it, and so does a rollback (inbox_handler_cleanup()).
 */
void
inbox_handler_enter(InboxSubscription *sub)
{
	reload_if_pending();
	GetUserIdAndSecContext(&scope_userid, &scope_sec);
	SetUserIdAndSecContext(sub->owner,
						   scope_sec | SECURITY_LOCAL_USERID_CHANGE |
						   SECURITY_RESTRICTED_OPERATION);
	scope_nestlevel = NewGUCNestLevel();
	(void) set_config_option("search_path", "\"$user\", public",
							 PGC_USERSET, PGC_S_SESSION, GUC_ACTION_SAVE,
							 true, 0, false);
	in_scope = true;
}

/*
 * inbox_handler_leave
 *		End the scope of inbox_handler_enter(): undo every setting the
 *		handlers changed, SET and set_config(..., false) included, as VACUUM
 *		and ANALYZE do after running a table owner's code (a setting can
 *		carry a tenant for row-level security into the next batch), and
 *		release session advisory locks (the worker's session outlives the
 *		batch, so a lock a handler forgot would be held until it exits).
 */
void
inbox_handler_leave(void)
{
	if (!in_scope)
		return;
	AtEOXact_GUC(false, scope_nestlevel);
	LockReleaseSession(USER_LOCKMETHOD);
	SetUserIdAndSecContext(scope_userid, scope_sec);
	in_scope = false;
}

/* invoke the handler on arg, under outbox.inbox_handler_timeout */
static void
invoke(Datum arg, const char *subscription, const InboxEvent *first,
	   int64 last_offset)
{
	LOCAL_FCINFO(fcinfo, 1);

	reload_if_pending();
	call_started = GetCurrentTimestamp();
	if (outbox_inbox_handler_timeout > 0)
		enable_timeout_after(STATEMENT_TIMEOUT, outbox_inbox_handler_timeout);
	InitFunctionCallInfoData(*fcinfo, &handler_flinfo, 1, InvalidOid, NULL, NULL);
	fcinfo->args[0].value = arg;
	fcinfo->args[0].isnull = false;
	inbox_attempts_calling(subscription, first, last_offset);
	inbox_applying = subscription;
	(void) FunctionCallInvoke(fcinfo);
	inbox_applying = NULL;
	inbox_attempts_called();
	if (outbox_inbox_handler_timeout > 0)
		disable_timeout(STATEMENT_TIMEOUT, false);
	call_started = 0;
}

/*
 * inbox_handler_call
 *		Call sub's per-event handler with ev, inside inbox_handler_enter().
 *		Any error propagates (the caller rolls back).
 */
void
inbox_handler_call(InboxSubscription *sub, const InboxEvent *ev)
{
	Assert(in_scope && handler_oid == sub->handler && !sub->batch_handler);
	invoke(inbox_event_datum(ev, sub->name), sub->name, ev, ev->offset);
}

/*
 * inbox_handler_call_batch
 *		Call sub's batch handler once with evs[0..n-1] (n >= 1) as an
 *		outbox.inbox_event[] in that order, inside inbox_handler_enter().
 *		Any error propagates.
 */
void
inbox_handler_call_batch(InboxSubscription *sub, InboxEvent **evs, int n)
{
	int64		last = evs[0]->offset;
	int			i;

	Assert(in_scope && handler_oid == sub->handler && sub->batch_handler);
	/* the in-flight record: the range of the first event's partition */
	for (i = 1; i < n; i++)
		if (evs[i]->partition == evs[0]->partition &&
			strcmp(evs[i]->topic, evs[0]->topic) == 0)
			last = evs[i]->offset;
	invoke(inbox_event_array(evs, n, sub->name), sub->name, evs[0], last);
}

/*
 * inbox_queue_batch
 *		Queue mode: insert evs[0..n-1] into outbox.inbox, in that order, with
 *		one statement, as the worker.
 */
void
inbox_queue_batch(InboxSubscription *sub, InboxEvent **evs, int n)
{
	Datum		values[1];
	int			ret;

	if (queue_many_plan == NULL)
	{
		Oid			types[1] = {get_array_type(inbox_event_type_oid())};

		queue_many_plan = SPI_prepare(QUEUE_SQL("SELECT e.subscription, e.topic, e.kafka_partition, e.kafka_offset, e.key,"
												"        e.event_id, e.event_type, e.aggregate_type, e.headers, e.payload,"
												"        e.payload_bytes, e.kafka_timestamp"
												"   FROM pg_catalog.unnest($1) WITH ORDINALITY AS e"
												"  ORDER BY e.ordinality"),
									  1, types);
		if (queue_many_plan == NULL || SPI_keepplan(queue_many_plan) != 0)
			elog(ERROR, "outbox inbox: could not prepare the queue insert");
	}
	values[0] = inbox_event_array(evs, n, sub->name);
	ret = SPI_execute_plan(queue_many_plan, values, NULL, false, 0);
	if (ret != SPI_OK_INSERT)
		elog(ERROR, "outbox inbox: queueing events failed: %s",
			 SPI_result_code_string(ret));
}

/*
 * inbox_apply_event
 *		Apply ev for sub in the current transaction, alone (a retried dead
 *		letter): call its handler (a batch handler with an array of one), or
 *		queue it.  Any error propagates; the caller rolls the transaction
 *		back (which also restores the user, the settings and the timeout
 *		this sets).
 */
void
inbox_apply_event(InboxSubscription *sub, const InboxEvent *ev)
{
	InboxEvent *one = (InboxEvent *) ev;

	if (sub->handler_text == NULL)
	{
		queue_event(sub, ev);
		return;
	}
	inbox_handler_enter(sub);
	if (sub->batch_handler)
		inbox_handler_call_batch(sub, &one, 1);
	else
		inbox_handler_call(sub, ev);
	inbox_handler_leave();
}

/*
 * inbox_handler_cleanup
 *		After an error: stop the handler's timeout if one is armed.  Returns
 *		whether the error came while a handler call had run at least
 *		outbox.inbox_handler_timeout (then a 57014 is its timeout, not a
 *		cancel by pg_cancel_backend(), which is retried).
 */
bool
inbox_handler_cleanup(void)
{
	bool		timed_out = false;

	inbox_applying = NULL;
	/* the rollback undid the user and the settings; session locks stay */
	if (in_scope)
		LockReleaseSession(USER_LOCKMETHOD);
	in_scope = false;
	if (call_started != 0)
	{
		disable_timeout(STATEMENT_TIMEOUT, false);
		timed_out = outbox_inbox_handler_timeout > 0 &&
			TimestampDifferenceExceeds(call_started, GetCurrentTimestamp(),
									   outbox_inbox_handler_timeout);
	}
	call_started = 0;
	return timed_out;
}

/*
 * inbox_handler_forget_plans
 *		Drop the kept queue plans; prepared again at next use.
 */
void
inbox_handler_forget_plans(void)
{
	if (queue_plan != NULL)
		SPI_freeplan(queue_plan);
	queue_plan = NULL;
	if (queue_many_plan != NULL)
		SPI_freeplan(queue_many_plan);
	queue_many_plan = NULL;
}
