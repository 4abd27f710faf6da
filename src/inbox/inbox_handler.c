/*-------------------------------------------------------------------------
 *
 * inbox_handler.c
 *	  What applying one event means: calling the subscription's handler,
 *	  or in queue mode inserting the event into outbox.inbox.
 *
 * The handler runs as the role that subscribed, never as the worker's
 * superuser: the worker switches to that role with
 * SECURITY_RESTRICTED_OPERATION (as PostgreSQL 16's logical replication
 * applies changes as the table owner, and maintenance commands run index
 * functions), so the handler, and any trigger it fires, cannot SET ROLE,
 * create temporary objects or leave session state behind.  Settings the
 * handler changes are undone after each call (a GUC nest level), and
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

		queue_plan = SPI_prepare("INSERT INTO outbox.inbox (subscription, topic, kafka_partition,"
								 " kafka_offset, key, event_id, event_type, aggregate_type, headers,"
								 " payload, payload_bytes, kafka_timestamp)"
								 " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)",
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

/*
 * Call the handler with ev as sub's owner (see the file header).
 */
static void
call_handler(InboxSubscription *sub, const InboxEvent *ev)
{
	LOCAL_FCINFO(fcinfo, 1);
	Oid			save_userid;
	int			save_sec;
	int			save_nestlevel;
	Datum		arg = inbox_event_datum(ev, sub->name);

	Assert(handler_oid == sub->handler);
	/* a reload of outbox.inbox_handler_timeout applies from this call on */
	if (ConfigReloadPending)
	{
		ConfigReloadPending = false;
		outbox_reload_config_file();
		inbox_config_reloaded = true;
	}
	GetUserIdAndSecContext(&save_userid, &save_sec);
	SetUserIdAndSecContext(sub->owner,
						   save_sec | SECURITY_LOCAL_USERID_CHANGE |
						   SECURITY_RESTRICTED_OPERATION);
	save_nestlevel = NewGUCNestLevel();
	(void) set_config_option("search_path", "\"$user\", public",
							 PGC_USERSET, PGC_S_SESSION, GUC_ACTION_SAVE,
							 true, 0, false);

	call_started = GetCurrentTimestamp();
	if (outbox_inbox_handler_timeout > 0)
		enable_timeout_after(STATEMENT_TIMEOUT, outbox_inbox_handler_timeout);

	InitFunctionCallInfoData(*fcinfo, &handler_flinfo, 1, InvalidOid, NULL, NULL);
	fcinfo->args[0].value = arg;
	fcinfo->args[0].isnull = false;
	inbox_attempts_calling(sub->name, ev);
	inbox_applying = sub->name;
	(void) FunctionCallInvoke(fcinfo);
	inbox_applying = NULL;
	inbox_attempts_called();

	if (outbox_inbox_handler_timeout > 0)
		disable_timeout(STATEMENT_TIMEOUT, false);
	call_started = 0;

	/*
	 * Undo every setting the handler changed, SET and set_config(..., false)
	 * included, as VACUUM and ANALYZE do after running a table owner's code:
	 * the next handler may belong to another role, and a setting can carry
	 * a tenant for row-level security.  Session advisory locks go too: the
	 * worker's session outlives the call, so a lock a handler forgot would
	 * be held until the worker exits.
	 */
	AtEOXact_GUC(false, save_nestlevel);
	LockReleaseSession(USER_LOCKMETHOD);
	SetUserIdAndSecContext(save_userid, save_sec);
}

/*
 * inbox_apply_event
 *		Apply ev for sub in the current transaction: call its handler, or
 *		queue it.  Any error propagates; the caller rolls the transaction
 *		back (which also restores the user, the settings and the timeout
 *		this sets).
 */
void
inbox_apply_event(InboxSubscription *sub, const InboxEvent *ev)
{
	if (sub->handler_text == NULL)
		queue_event(sub, ev);
	else
		call_handler(sub, ev);
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
 *		Drop the kept queue plan; prepared again at next use.
 */
void
inbox_handler_forget_plans(void)
{
	if (queue_plan != NULL)
		SPI_freeplan(queue_plan);
	queue_plan = NULL;
}
