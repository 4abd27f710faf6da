/*-------------------------------------------------------------------------
 *
 * inbox_subscription.c
 *	  The subscription of an inbox worker, as the worker holds it between
 *	  two reloads.
 *
 * The worker reads its row of outbox.subscriptions when it starts and again whenever
 * the SQL API committed a change (subscribe, unsubscribe, pause, resume,
 * seek, retry bump the worker's control counter) or a batch failed for a
 * reason other than a handler.  A subscription consumes only when it is
 *	- not paused,
 *	- not a restored copy: the cluster's system identifier is the one it was
 *	  made in, and so is the database (same OID or same name),
 *	- not owned by a superuser while outbox.inbox_superuser_subscriptions is
 *	  off,
 *	- and its handler (if any) still resolves.
 * Its consumer is kept across reloads while the settings stay; its
 * partitions are assigned again from the offsets in the table.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "inbox/inbox.h"

#include "catalog/pg_proc.h"
#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "utils/acl.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"

static InboxSubscription *subscription_from_row(HeapTuple row, TupleDesc desc);

/*
 * inbox_load_subscriptions
 *		Read subscription name (with SPI connected, in a transaction) into a
 *		new List (in TopMemoryContext) of one InboxSubscription, in a memory
 *		context of its own, without partitions, for the worker of slice of
 *		nslices.  A consumer of old that still fits the settings moves over;
 *		old is freed with what is left of it.  *any: whether the
 *		subscription exists (the List is NIL if not).
 */
List *
inbox_load_subscriptions(List *old, const char *name, int slice, int nslices,
						 bool *any)
{
	Datum		args[1];

	List	   *subs = NIL;
	int			ret;
	uint64		i;
	ListCell   *lc;
	MemoryContext oldcxt;

	args[0] = CStringGetTextDatum(name);
	ret = SPI_execute_with_args("SELECT s.name, s.owner::pg_catalog.oid, s.topics, s.handler,"
					  "       pg_catalog.to_regprocedure(s.handler)::pg_catalog.oid,"
					  "       s.on_failed_event = 'hold', s.dedupe, s.start_from, s.started, s.paused,"
					  "       s.system_identifier <> (SELECT c.system_identifier FROM pg_catalog.pg_control_system() AS c)"
					  "       OR (s.database_oid <> (SELECT d.oid FROM pg_catalog.pg_database AS d"
					  "                               WHERE d.datname = pg_catalog.current_database())"
					  "           AND s.database_name <> pg_catalog.current_database()),"
					  "       EXISTS (SELECT 1 FROM outbox.inbox_dead AS x WHERE x.subscription = s.name AND x.retry)"
					  "  FROM outbox.subscriptions AS s WHERE s.name = $1",
					  1, (Oid[]) {TEXTOID}, args, NULL, true, 0);
	if (ret != SPI_OK_SELECT)
		elog(ERROR, "outbox inbox: reading the subscriptions failed: %s",
			 SPI_result_code_string(ret));
	*any = SPI_processed > 0;
	for (i = 0; i < SPI_processed; i++)
	{
		InboxSubscription *sub = subscription_from_row(SPI_tuptable->vals[i],
													   SPI_tuptable->tupdesc);

		sub->slice = slice;
		sub->nslices = nslices;
		/* dead letters are retried by slice 0 alone: never twice at once */
		if (slice != 0)
			sub->retry_pending = false;
		oldcxt = MemoryContextSwitchTo(TopMemoryContext);
		subs = lappend(subs, sub);
		MemoryContextSwitchTo(oldcxt);
	}

	foreach(lc, subs)
	{
		InboxSubscription *sub = lfirst(lc);
		ListCell   *oc;

		if (sub->copy)
			continue;
		foreach(oc, old)
		{
			InboxSubscription *o = lfirst(oc);

			if (strcmp(o->name, sub->name) == 0 && o->consumer != NULL &&
				!inbox_consumer_settings_changed(o->consumer))
			{
				sub->consumer = o->consumer;
				o->consumer = NULL;
			}
		}
	}
	foreach(lc, old)
		inbox_free_subscription(lfirst(lc));
	list_free(old);
	return subs;
}

/* one row of the query above, in a memory context of its own */
static InboxSubscription *
subscription_from_row(HeapTuple row, TupleDesc desc)
{
	MemoryContext cxt = AllocSetContextCreate(TopMemoryContext, "outbox inbox subscription",
											  ALLOCSET_SMALL_SIZES);
	MemoryContext oldcxt = MemoryContextSwitchTo(cxt);
	InboxSubscription *sub = palloc0(sizeof(InboxSubscription));
	bool		isnull;
	Datum		d;
	ArrayType  *topics;
	Datum	   *elems;
	bool	   *elem_nulls;
	int			n;
	int			t;

	strlcpy(sub->name, TextDatumGetCString(SPI_getbinval(row, desc, 1, &isnull)), NAMEDATALEN);
	sub->owner = DatumGetObjectId(SPI_getbinval(row, desc, 2, &isnull));
	topics = DatumGetArrayTypeP(SPI_getbinval(row, desc, 3, &isnull));
	deconstruct_array(topics, TEXTOID, -1, false, TYPALIGN_INT, &elems, &elem_nulls, &n);
	sub->topics = palloc(sizeof(char *) * Max(n, 1));
	sub->topic_status = palloc(sizeof(int) * Max(n, 1));
	for (t = 0; t < n; t++)
	{
		if (elem_nulls[t])
			continue;
		sub->topic_status[sub->ntopics] = -1;
		sub->topics[sub->ntopics++] = TextDatumGetCString(elems[t]);
	}
	d = SPI_getbinval(row, desc, 4, &isnull);
	sub->handler_text = isnull ? NULL : TextDatumGetCString(d);
	d = SPI_getbinval(row, desc, 5, &isnull);
	sub->handler = isnull ? InvalidOid : DatumGetObjectId(d);
	sub->handler_missing = sub->handler_text != NULL && !OidIsValid(sub->handler);
	if (OidIsValid(sub->handler))
	{
		Oid		   *argtypes;
		int			nargs;

		(void) get_func_signature(sub->handler, &argtypes, &nargs);
		sub->batch_handler = nargs == 1 &&
			argtypes[0] == get_array_type(inbox_event_type_oid());
	}
	sub->hold = DatumGetBool(SPI_getbinval(row, desc, 6, &isnull));
	sub->dedupe = DatumGetBool(SPI_getbinval(row, desc, 7, &isnull));
	sub->start_from = TextDatumGetCString(SPI_getbinval(row, desc, 8, &isnull));
	sub->started = DatumGetBool(SPI_getbinval(row, desc, 9, &isnull));
	sub->paused = DatumGetBool(SPI_getbinval(row, desc, 10, &isnull));
	sub->copy = DatumGetBool(SPI_getbinval(row, desc, 11, &isnull));
	sub->retry_pending = DatumGetBool(SPI_getbinval(row, desc, 12, &isnull));
	sub->refused = superuser_arg(sub->owner) && !outbox_inbox_superuser_subscriptions;
	if (sub->refused)
		sub->problem = psprintf("the subscription's role \"%s\" is a superuser and outbox.inbox_superuser_subscriptions is off: nothing is applied",
								GetUserNameFromId(sub->owner, true) ? GetUserNameFromId(sub->owner, true) : "?");
	else if (sub->handler_missing)
		sub->problem = psprintf("handler %s does not exist: nothing is applied until it is created again",
								sub->handler_text);
	else if (OidIsValid(sub->handler) &&
			 outbox_proc_aclcheck(sub->handler, sub->owner, ACL_EXECUTE) != ACLCHECK_OK)
		sub->problem = psprintf("role \"%s\" may not execute handler %s: nothing is applied until it may",
								GetUserNameFromId(sub->owner, true) ? GetUserNameFromId(sub->owner, true) : "?",
								sub->handler_text);
	sub->cxt = cxt;
	MemoryContextSwitchTo(oldcxt);
	return sub;
}

/*
 * inbox_subscription_active
 *		Does sub consume (see the file header)?
 */
bool
inbox_subscription_active(const InboxSubscription *sub)
{
	return !sub->paused && !sub->copy && sub->problem == NULL;
}

/*
 * inbox_subscription_problem
 *		Why an unpaused subscription that is no copy does not consume, in
 *		words for outbox.inbox_status (made when it was loaded: no catalog
 *		access here, so it may be asked outside a transaction), or NULL if it
 *		does.
 */
const char *
inbox_subscription_problem(const InboxSubscription *sub)
{
	return sub->problem;
}

/*
 * inbox_free_subscription
 *		Free sub, its consumer and partition list; its shared status entries
 *		are released by the caller (inbox_status_release_all).
 */
void
inbox_free_subscription(InboxSubscription *sub)
{
	inbox_consumer_destroy(sub->consumer);
	MemoryContextDelete(sub->cxt);
}

/*
 * inbox_start_offset
 *		Where a partition sub has no row for begins: at its first offset (-2)
 *		once sub has started; before, as start_from says: earliest (-2),
 *		latest (-1), an offset, or the first record at or after a time (from
 *		Kafka).
 */
int64
inbox_start_offset(InboxSubscription *sub, const char *topic, int32 partition)
{
	InboxPosition pos;
	int64		offset;

	if (sub->started)
		return -2;
	inbox_parse_position(sub->start_from, "start_from", &pos);
	switch (pos.kind)
	{
		case INBOX_POSITION_EARLIEST:
			return -2;
		case INBOX_POSITION_LATEST:
			return -1;
		case INBOX_POSITION_OFFSET:
			return pos.offset;
		case INBOX_POSITION_TIME:
			break;
	}
	if (!inbox_consumer_resolve_time(sub, topic, partition, pos.time, &offset))
		ereport(ERROR,
				(errcode(ERRCODE_CONNECTION_FAILURE),
				 errmsg("Kafka did not say which offset of topic \"%s\", partition %d is at %s",
						topic, partition, sub->start_from),
				 errhint("The inbox asks again.")));
	return offset;
}

/*
 * inbox_note_missing_topic
 *		Topic of sub does not exist (yet): show it as waiting_for_topic.
 */
void
inbox_note_missing_topic(InboxSubscription *sub, const char *topic)
{
	int			t;

	for (t = 0; t < sub->ntopics; t++)
	{
		/* slice 0 shows it, once */
		if (strcmp(sub->topics[t], topic) != 0 || sub->slice != 0)
			continue;
		if (sub->topic_status[t] < 0)
			sub->topic_status[t] = inbox_status_claim(sub->name, topic, -1);
		inbox_status_set(sub->topic_status[t], INBOX_STATE_WAITING_FOR_TOPIC, NULL);
	}
}

/*
 * inbox_forget_missing_topic
 *		Topic of sub exists: its partitions show from now on.
 */
void
inbox_forget_missing_topic(InboxSubscription *sub, const char *topic)
{
	int			t;

	for (t = 0; t < sub->ntopics; t++)
		if (strcmp(sub->topics[t], topic) == 0 && sub->topic_status[t] >= 0)
			inbox_status_set(sub->topic_status[t], INBOX_STATE_RUNNING, NULL);
}
