/*-------------------------------------------------------------------------
 *
 * secrets.c
 *	  Keep the secrets of outbox.kafka_properties out of the server log,
 *	  pg_stat_activity and pg_stat_statements.
 *
 * The value may hold SASL or TLS key passwords.  Its GUC shows it masked
 * (outbox_check_kafka_properties in kafka_config.c); what is left is
 * PostgreSQL quoting the value by itself:
 *	- the emit_log_hook shortens the log lines that would quote it,
 *	- the ProcessUtility_hook replaces the text of ALTER SYSTEM SET
 *	  outbox.kafka_properties before pg_stat_activity and
 *	  pg_stat_statements see it,
 *	- a check at server start warns when the order of
 *	  shared_preload_libraries makes pg_stat_statements see it first,
 *	- librdkafka's own texts, which may quote a value (a keystore's path),
 *	  are scrubbed of the secret values before they are shown
 *	  (outbox_kafka_scrub_secrets: the relay's and the inbox's).
 * _PG_init installs both hooks in every process that loads the library.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "config/secrets.h"
#include "config/kafka_config.h"

#include "lib/stringinfo.h"
#include "nodes/parsenodes.h"
#include "pgstat.h"
#include "tcop/tcopprot.h"
#include "utils/guc.h"
#include "utils/varlena.h"

/* the hooks installed before ours (set by _PG_init) */
emit_log_hook_type outbox_prev_emit_log_hook = NULL;
ProcessUtility_hook_type outbox_prev_process_utility_hook = NULL;

static bool mentions_kafka_properties(const char *s);
static char *masked_statement(const char *queryString, const char *name,
							  const PlannedStmt *pstmt);
static bool library_is(const char *name, const char *library);

/*
 * True if s contains "kafka_properties", ignoring case: SQL that sets the
 * parameter may spell it in any case.
 */
static bool
mentions_kafka_properties(const char *s)
{
	const char *needle = "kafka_properties";
	size_t		n = strlen(needle);

	for (; s != NULL && *s; s++)
	{
		if (pg_strncasecmp(s, needle, n) == 0)
			return true;
	}
	return false;
}

/*
 * outbox_emit_log_hook
 *		The emit_log_hook.  PostgreSQL itself would write the value of
 *		outbox.kafka_properties to the server log when a reload changes it
 *		("parameter ... changed to ..."), and any statement that sets it
 *		(log_statement, or the STATEMENT line after an error).  Those may
 *		hold SASL or TLS key passwords, so such lines are replaced or
 *		shortened here.
 */
void
outbox_emit_log_hook(ErrorData *edata)
{
	if (outbox_prev_emit_log_hook)
		outbox_prev_emit_log_hook(edata);
	if (!edata->output_to_server)
		return;

	if (edata->message != NULL && mentions_kafka_properties(edata->message) &&
		edata->message_id != NULL &&
		strcmp(edata->message_id, "parameter \"%s\" changed to \"%s\"") == 0)
	{
		/* keep the name: outbox.kafka_properties or outbox.inbox_kafka_properties */
		const char *prefix = "parameter \"";
		bool		english = strncmp(edata->message, prefix, strlen(prefix)) == 0;
		const char *name = english ? edata->message + strlen(prefix) : "";
		const char *end = english ? strchr(name, '"') : NULL;

		if (end == NULL)
			edata->message = pstrdup("a parameter naming kafka_properties changed (value not logged)");
		else
			edata->message = psprintf("parameter \"%.*s\" changed (value not logged)",
									  (int) (end - name), name);
	}

	if (debug_query_string != NULL && mentions_kafka_properties(debug_query_string))
	{
		/* the STATEMENT: line after an error */
		edata->hide_stmt = true;
		/* log_statement and log_min_duration_statement lines quote it whole */
		if (edata->message != NULL && strstr(edata->message, debug_query_string) != NULL)
			edata->message = pstrdup("statement: (a statement mentioning outbox.kafka_properties, not logged)");
	}

	/* a statement run by a function (EXECUTE in a DO block, say) */
	if (edata->context != NULL && mentions_kafka_properties(edata->context))
		edata->context = pstrdup("(a statement mentioning outbox.kafka_properties, not logged)");
	if (edata->internalquery != NULL && mentions_kafka_properties(edata->internalquery))
		edata->internalquery = NULL;
}

/*
 * The text of the statement pstmt came from, with that statement replaced
 * by a line that names the parameter and no value, padded with blanks to
 * the same length: hooks called after this one find the statement at the
 * location and length the parser gave (pg_stat_statements cuts it out by
 * them, and trims the blanks).
 */
static char *
masked_statement(const char *queryString, const char *name,
				 const PlannedStmt *pstmt)
{
	char	   *replacement = psprintf("ALTER SYSTEM SET %s = '(not shown)'", name);
	size_t		len = strlen(queryString);
	size_t		start = pstmt->stmt_location >= 0 ? pstmt->stmt_location : 0;
	size_t		end = pstmt->stmt_location >= 0 && pstmt->stmt_len > 0 ?
		start + pstmt->stmt_len : len;
	char	   *masked = pstrdup(queryString);

	if (start > len)
		start = len;
	if (end > len || pstmt->stmt_location < 0)
		end = len;
	memset(masked + start, ' ', end - start);
	memcpy(masked + start, replacement, Min(end - start, strlen(replacement)));
	return masked;
}

/*
 * outbox_process_utility
 *		The ProcessUtility_hook.  ALTER SYSTEM SET outbox.kafka_properties
 *		carries the value, which may hold passwords, in its text.
 *		PostgreSQL would show that text in pg_stat_activity (to
 *		pg_read_all_stats members, and for an idle session until its next
 *		statement) and pg_stat_statements would keep it for its readers.
 *
 * Here the statement's text is replaced before either sees it:
 * pg_stat_activity's query always, and pg_stat_statements' copy when this
 * hook runs before that module's, i.e. when outbox comes after
 * pg_stat_statements in shared_preload_libraries (hooks run in the reverse
 * order of loading).  The statement itself runs from its parse tree.
 */
void
outbox_process_utility(PlannedStmt *pstmt, const char *queryString,
					   bool readOnlyTree, ProcessUtilityContext context,
					   ParamListInfo params, QueryEnvironment *queryEnv,
					   DestReceiver *dest, QueryCompletion *qc)
{
	Node	   *stmt = pstmt->utilityStmt;

	if (IsA(stmt, AlterSystemStmt) &&
		((AlterSystemStmt *) stmt)->setstmt->kind == VAR_SET_VALUE &&
		mentions_kafka_properties(((AlterSystemStmt *) stmt)->setstmt->name))
	{
		queryString = masked_statement(queryString,
									   ((AlterSystemStmt *) stmt)->setstmt->name, pstmt);
		pgstat_report_activity(STATE_RUNNING, queryString);
	}

	if (outbox_prev_process_utility_hook)
		outbox_prev_process_utility_hook(pstmt, queryString, readOnlyTree,
										 context, params, queryEnv, dest, qc);
	else
		standard_ProcessUtility(pstmt, queryString, readOnlyTree, context,
								params, queryEnv, dest, qc);
}

/*
 * True if the shared_preload_libraries item name ("outbox",
 * "$libdir/outbox", "outbox.so") names library.
 */
static bool
library_is(const char *name, const char *library)
{
	const char *base = strrchr(name, '/') ? strrchr(name, '/') + 1 : name;
	size_t		len = strcspn(base, ".");

	return len == strlen(library) && strncmp(base, library, len) == 0;
}

/*
 * outbox_check_preload_order
 *		WARNING at server start when pg_stat_statements comes after outbox in
 *		shared_preload_libraries: its ProcessUtility hook then runs before
 *		ours and records ALTER SYSTEM SET outbox.kafka_properties with the
 *		value (see outbox_process_utility).  Called from _PG_init in the
 *		postmaster.
 */
void
outbox_check_preload_order(void)
{
	char	   *list = pstrdup(GetConfigOption("shared_preload_libraries", false, false));
	List	   *names;
	ListCell   *lc;
	int			position = 0;
	int			outbox_at = -1;
	int			pgss_at = -1;

	if (!SplitDirectoriesString(list, ',', &names))
		return;
	foreach(lc, names)
	{
		const char *name = (const char *) lfirst(lc);

		if (outbox_at < 0 && library_is(name, "outbox"))
			outbox_at = position;
		if (library_is(name, "pg_stat_statements"))
			pgss_at = position;
		position++;
	}
	if (outbox_at >= 0 && pgss_at > outbox_at)
		ereport(WARNING,
				(errmsg("outbox is listed before pg_stat_statements in shared_preload_libraries"),
				 errdetail("pg_stat_statements then records ALTER SYSTEM SET outbox.kafka_properties with its value, which may hold passwords, for its readers (pg_read_all_stats)."),
				 errhint("List outbox after it: shared_preload_libraries = 'pg_stat_statements,outbox'.")));
}

/*
 * outbox_kafka_scrub_secrets
 *		Replace, in text (a NUL-terminated buffer of size bytes), every
 *		occurrence of the value of a secret property of properties (the text
 *		of outbox.kafka_properties) by "********", cutting the result at
 *		size - 1 bytes.
 *
 * librdkafka's own error texts quote some values: "Failed to open
 * ssl.keystore.location: /path" names the file, whose path may be the very
 * thing SHOW masks.  Every text of librdkafka's that reaches outbox.status
 * or the log goes through here first.  Worker's thread only (it pallocs);
 * raises no error: a properties text that does not parse scrubs nothing,
 * as no producer could have been built from it.
 */
void
outbox_kafka_scrub_secrets(char *text, size_t size, const char *properties)
{
	OutboxKafkaProperty *props;
	int			nprops;
	char	   *error;

	if (text == NULL || text[0] == '\0' || properties == NULL || properties[0] == '\0' ||
		!outbox_parse_kafka_properties(properties, &props, &nprops, &error))
		return;
	for (int i = 0; i < nprops; i++)
	{
		const char *value = props[i].value;
		size_t		len = strlen(value);
		StringInfoData buf;
		const char *from = text;
		const char *hit;

		if (len == 0 || !outbox_kafka_property_is_secret(props[i].key) ||
			strstr(text, value) == NULL)
			continue;
		initStringInfo(&buf);
		while ((hit = strstr(from, value)) != NULL)
		{
			appendBinaryStringInfo(&buf, from, hit - from);
			appendStringInfoString(&buf, "********");
			from = hit + len;
		}
		appendStringInfoString(&buf, from);
		strlcpy(text, buf.data, size);
		pfree(buf.data);
	}
}
