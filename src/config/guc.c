/*-------------------------------------------------------------------------
 *
 * guc.c
 *	  The outbox.* configuration parameters.
 *
 * Settings that only the relay worker reads at connect time are
 * PGC_POSTMASTER; everything about Kafka and the relay loop is PGC_SIGHUP so
 * that a DBA can change it with pg_reload_conf() and no restart.  The worker
 * re-reads them between batches (see worker.c).
 *
 * This file holds the settings only.  The rules their values are checked
 * against are in topic.c and kafka_config.c; the hooks that keep the
 * secrets of outbox.kafka_properties out of view are in secrets.c.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "config/guc.h"
#include "config/cloudevents.h"
#include "config/dblist.h"
#include "config/guc_refusal.h"
#include "config/kafka_config.h"
#include "config/topic.h"
#include "config/inbox_guc.h"

#include <ctype.h>
#include <limits.h>

#include "miscadmin.h"
#include "lib/stringinfo.h"
#include "utils/guc.h"

char	   *outbox_database = NULL;
char	   *outbox_databases = NULL;
int			outbox_max_workers = 8;
int			outbox_workers_per_database = 1;
char	   *outbox_bootstrap_servers = NULL;
char	   *outbox_topic_prefix = NULL;
int			outbox_batch_size = 5000;
int			outbox_poll_interval = 1000;
char	   *outbox_kafka_properties = "";

/*
 * The GUC variable of outbox.kafka_properties holds the value with secrets
 * masked (see outbox_check_kafka_properties), so that no view of it (SHOW,
 * pg_settings.setting and reset_val, log lines) can show them; the real
 * value lives in the GUC's extra and outbox_kafka_properties points to it.
 */
static char *kafka_properties_masked = NULL;

int			outbox_retention = 60;
int			outbox_vacuum_interval = 5;
int			outbox_delivery_timeout = 30000;
int			outbox_retry_backoff_max = 30000;
int			outbox_max_attempts = 10;
int			outbox_on_failed_event = OUTBOX_ON_FAILED_HOLD;
int			outbox_relay_mode = OUTBOX_RELAY_SNAPSHOT;
int			outbox_delivery = OUTBOX_DELIVERY_AT_LEAST_ONCE;
char	   *outbox_progress_topic = NULL;
char	   *outbox_allowed_topics = NULL;
char	   *outbox_role = NULL;
int			outbox_message_format = OUTBOX_FORMAT_DEBEZIUM;
static char *outbox_message_format_name = NULL;
char	   *outbox_ce_source = NULL;
char	   *outbox_traceparent = NULL;
char	   *outbox_tracestate = NULL;

/* parsed outbox.allowed_topics (see outbox_topic_list_pack), the GUC's extra */
const char *outbox_allowed_topic_list = NULL;

static const struct config_enum_entry on_failed_event_options[] = {
	{"hold", OUTBOX_ON_FAILED_HOLD, false},
	{"skip", OUTBOX_ON_FAILED_SKIP, false},
	{NULL, 0, false}
};

static const struct config_enum_entry relay_mode_options[] = {
	{"row", OUTBOX_RELAY_ROW, false},
	{"snapshot", OUTBOX_RELAY_SNAPSHOT, false},
	{NULL, 0, false}
};

static const struct config_enum_entry delivery_options[] = {
	{"at_least_once", OUTBOX_DELIVERY_AT_LEAST_ONCE, false},
	{"exactly_once", OUTBOX_DELIVERY_EXACTLY_ONCE, false},
	{NULL, 0, false}
};

static bool check_topic_prefix(char **newval, void **extra, GucSource source);
static bool check_progress_topic(char **newval, void **extra, GucSource source);
static bool check_message_format(char **newval, void **extra, GucSource source);
static void assign_message_format(const char *newval, void *extra);
static bool check_ce_source(char **newval, void **extra, GucSource source);
static void assign_ce_source(const char *newval, void *extra);
static void assign_kafka_properties(const char *newval, void *extra);
static bool check_allowed_topics(char **newval, void **extra,
								 GucSource source);
static void assign_allowed_topics(const char *newval, void *extra);
static bool split_list(char *list, List **items);

/*
 * outbox_define_gucs
 *		Define every outbox.* parameter.  Called from _PG_init in every
 *		process that loads the library, preloaded or not, so that SHOW and
 *		current_setting() work everywhere and emit() sees the topic prefix.
 */
void
outbox_define_gucs(void)
{
	/*
	 * Read by the relay worker when it connects, so it can only change with a
	 * restart.  PGC_POSTMASTER variables can only be created by the
	 * postmaster; when the library is loaded later (no worker will run) the
	 * same variable is defined as PGC_SIGHUP so that loading never fails.
	 */
	DefineCustomStringVariable("outbox.database",
							   "Database the outbox relay worker connects to.",
							   "Only this database's outbox.events table is relayed.",
							   &outbox_database,
							   "postgres",
							   process_shared_preload_libraries_in_progress ?
							   PGC_POSTMASTER : PGC_SIGHUP,
							   0,
							   outbox_check_database, NULL, NULL);

	DefineCustomStringVariable("outbox.databases",
							   "Databases the outbox launcher keeps a relay for.",
							   "A comma-separated list of database names, or * for every database that accepts connections, is not a template and has the extension. Empty means the one database of outbox.database.",
							   &outbox_databases,
							   "",
							   PGC_SIGHUP,
							   0,
							   outbox_check_databases, NULL, NULL);

	DefineCustomIntVariable("outbox.max_workers",
							"Most relay workers the outbox launcher runs at once.",
							"Databases beyond this number are not relayed; the log says which.",
							&outbox_max_workers,
							8, 1, 256,
							process_shared_preload_libraries_in_progress ?
							PGC_POSTMASTER : PGC_SIGHUP,
							0,
							NULL, NULL, NULL);

	DefineCustomIntVariable("outbox.workers_per_database",
							"Relay workers that share each database's events by key bucket.",
							"Each has its own Kafka producer (and transactional id with outbox.delivery = exactly_once); above 1, new events are tracked row by row.",
							&outbox_workers_per_database,
							1, 1, OUTBOX_MAX_WORKERS_PER_DATABASE,
							PGC_SIGHUP,
							0,
							NULL, NULL, NULL);

	DefineCustomStringVariable("outbox.bootstrap_servers",
							   "Kafka bootstrap servers (host:port,...) the relay publishes to.",
							   "Empty means the relay worker idles and publishes nothing.",
							   &outbox_bootstrap_servers,
							   "",
							   PGC_SIGHUP,
							   0,
							   outbox_check_bootstrap_servers, NULL, NULL);

	DefineCustomStringVariable("outbox.topic_prefix",
							   "Prefix of routed topic names: topic = prefix || aggregate_type.",
							   "Used for events emitted without an explicit topic.",
							   &outbox_topic_prefix,
							   "outbox.event.",
							   PGC_SIGHUP,
							   0,
							   check_topic_prefix, NULL, NULL);

	DefineCustomIntVariable("outbox.batch_size",
							"Maximum number of events the relay claims and publishes per transaction.",
							"Larger batches spread the cost of each transaction over more events; a crash may send the batch in flight again.",
							&outbox_batch_size,
							5000, 1, 100000,
							PGC_SIGHUP,
							0,
							NULL, NULL, NULL);

	DefineCustomIntVariable("outbox.poll_interval",
							"Time between polls of the outbox table when no commit woke the relay.",
							NULL,
							&outbox_poll_interval,
							1000, 10, 3600 * 1000,
							PGC_SIGHUP,
							GUC_UNIT_MS,
							NULL, NULL, NULL);

	DefineCustomStringVariable("outbox.kafka_properties",
							   "Extra librdkafka producer properties, as key=value;key=value.",
							   "Applied after the relay's own defaults. Write a ';' inside a value as \\;, a backslash as \\\\. Only superusers can see or set this.",
							   &kafka_properties_masked,
							   "",
							   PGC_SIGHUP,
							   GUC_SUPERUSER_ONLY,
							   outbox_check_kafka_properties, assign_kafka_properties, NULL);

	DefineCustomIntVariable("outbox.retention",
							"How long published events are kept before the relay deletes them.",
							"-1 keeps them forever; 0 deletes them as soon as Kafka acknowledged them.",
							&outbox_retention,
							60, -1, INT_MAX,
							PGC_SIGHUP,
							GUC_UNIT_S,
							NULL, NULL, NULL);

	DefineCustomIntVariable("outbox.vacuum_interval",
							"Least time between the VACUUMs of outbox.events the relay starts after retention deleted rows.",
							"0 leaves the table to autovacuum alone.",
							&outbox_vacuum_interval,
							5, 0, 3600,
							PGC_SIGHUP,
							GUC_UNIT_S,
							NULL, NULL, NULL);

	DefineCustomIntVariable("outbox.delivery_timeout",
							"How long the relay waits for Kafka to acknowledge an event before the attempt counts as failed.",
							"Sets librdkafka's message.timeout.ms.",
							&outbox_delivery_timeout,
							30000, 1000, 3600 * 1000,
							PGC_SIGHUP,
							GUC_UNIT_MS,
							NULL, NULL, NULL);

	DefineCustomIntVariable("outbox.retry_backoff_max",
							"Upper bound of the exponential backoff between delivery attempts of a failed event.",
							NULL,
							&outbox_retry_backoff_max,
							30000, 100, 3600 * 1000,
							PGC_SIGHUP,
							GUC_UNIT_MS,
							NULL, NULL, NULL);

	DefineCustomIntVariable("outbox.max_attempts",
							"Delivery attempts Kafka may refuse with a permanent error before an event is marked failed.",
							"Transient failures (broker unreachable, timeouts) never count.",
							&outbox_max_attempts,
							10, 1, 1000000,
							PGC_SIGHUP,
							0,
							NULL, NULL, NULL);

	DefineCustomEnumVariable("outbox.on_failed_event",
							 "What later events of an aggregate do when one of its events is marked failed.",
							 "hold: they wait behind it until outbox.retry_failed(), keeping the aggregate's order; skip: they go on without it.",
							 &outbox_on_failed_event,
							 OUTBOX_ON_FAILED_HOLD,
							 on_failed_event_options,
							 PGC_SIGHUP,
							 0,
							 NULL, NULL, NULL);

	DefineCustomEnumVariable("outbox.relay_mode",
							 "How new events are tracked until Kafka acknowledged them.",
							 "row: each event is locked by the relay and updated once published (1.3); snapshot: the relay keeps one progress record, the commit snapshot up to which everything is published, and never writes an event row on the way (schema 1.4).",
							 &outbox_relay_mode,
							 OUTBOX_RELAY_SNAPSHOT,
							 relay_mode_options,
							 PGC_SIGHUP,
							 0,
							 NULL, NULL, NULL);

	DefineCustomEnumVariable("outbox.delivery",
							 "What a crash of the relay, Postgres or a broker may cost consumers.",
							 "at_least_once: an event may be sent again, consumers drop it by its id header; exactly_once: each batch is one Kafka transaction with the relay's progress, and read_committed consumers see each event once.",
							 &outbox_delivery,
							 OUTBOX_DELIVERY_AT_LEAST_ONCE,
							 delivery_options,
							 PGC_SIGHUP,
							 0,
							 NULL, NULL, NULL);

	DefineCustomStringVariable("outbox.progress_topic",
							   "Topic of the relay's progress records with outbox.delivery = exactly_once.",
							   "One partition, cleanup.policy = compact; created by the relay when missing. Shared by every relay of the Kafka cluster, keyed by transactional.id.",
							   &outbox_progress_topic,
							   "_outbox_progress",
							   PGC_SIGHUP,
							   0,
							   check_progress_topic, NULL, NULL);

	DefineCustomStringVariable("outbox.allowed_topics",
							   "Topics outbox.emit() and outbox.capture() accept, comma-separated.",
							   "An entry ending in * allows every topic that starts with the rest. Empty allows every topic.",
							   &outbox_allowed_topics,
							   "",
							   PGC_SIGHUP,
							   0,
							   check_allowed_topics, assign_allowed_topics, NULL);

	DefineCustomStringVariable("outbox.role",
							   "Role the relay worker connects as.",
							   "Empty means the bootstrap superuser. The role needs LOGIN, USAGE on schema outbox, SELECT, UPDATE, DELETE on outbox.events and SELECT on outbox.relay.",
							   &outbox_role,
							   "",
							   process_shared_preload_libraries_in_progress ?
							   PGC_POSTMASTER : PGC_SIGHUP,
							   0,
							   NULL, NULL, NULL);

	/* a string, not an enum: its check hook sees a value refused at start */
	DefineCustomStringVariable("outbox.message_format",
							   "The shape of the messages the relay produces: debezium or cloudevents.",
							   "debezium: key, JSON value and the headers id, event_type, aggregate_type; cloudevents: the CloudEvents 1.0 Kafka binding in binary content mode (ce_* headers).",
							   &outbox_message_format_name,
							   "debezium",
							   PGC_SIGHUP,
							   0,
							   check_message_format, assign_message_format, NULL);

	/* PGC_SUSET so that ALTER DATABASE ... SET can give each database its own */
	DefineCustomStringVariable("outbox.ce_source",
							   "The CloudEvents source (a URI reference) of the events of this database.",
							   "Empty means /postgresql/<system identifier>/<database name>.",
							   &outbox_ce_source,
							   "",
							   PGC_SUSET,
							   0,
							   check_ce_source, assign_ce_source, NULL);

	/* any user: an application's middleware sets them with SET LOCAL */
	DefineCustomStringVariable("outbox.traceparent",
							   "W3C traceparent that emit() and capture() add to events without one.",
							   "A malformed value is ignored. Overrides the traceparent of the statement's sqlcommenter comment.",
							   &outbox_traceparent,
							   "",
							   PGC_USERSET,
							   0,
							   NULL, NULL, NULL);

	DefineCustomStringVariable("outbox.tracestate",
							   "W3C tracestate added with outbox.traceparent.",
							   "Ignored when malformed or when outbox.traceparent is not set.",
							   &outbox_tracestate,
							   "",
							   PGC_USERSET,
							   0,
							   NULL, NULL, NULL);

	/* the inbox's outbox.inbox_* settings (src/inbox/inbox_guc.c) */
	outbox_inbox_define_gucs();

	MarkGUCPrefixReserved("outbox");
}

/*
 * outbox.message_format: debezium or cloudevents, in any case.  A value
 * refused at server start stops the relay (guc_refusal.c): consumers would
 * get messages of the other shape.
 */
static bool
check_message_format(char **newval, void **extra, GucSource source)
{
	if (pg_strcasecmp(*newval, "debezium") == 0 ||
		pg_strcasecmp(*newval, "cloudevents") == 0)
		return true;
	GUC_check_errdetail("Available values: debezium, cloudevents.");
	outbox_note_refusal(OUTBOX_REFUSABLE_MESSAGE_FORMAT, source,
						"not debezium or cloudevents");
	return false;
}

static void
assign_message_format(const char *newval, void *extra)
{
	outbox_message_format = pg_strcasecmp(newval, "cloudevents") == 0 ?
		OUTBOX_FORMAT_CLOUDEVENTS : OUTBOX_FORMAT_DEBEZIUM;
	outbox_clear_refusal(OUTBOX_REFUSABLE_MESSAGE_FORMAT);
}

/*
 * outbox.ce_source: empty (the default source) or a URI reference a
 * CloudEvents consumer can read (cloudevents.c).  A value refused at server
 * start stops the relay, as for outbox.message_format.
 */
static bool
check_ce_source(char **newval, void **extra, GucSource source)
{
	if ((*newval)[0] == '\0' || outbox_uri_reference_is_valid(*newval, strlen(*newval)))
		return true;
	GUC_check_errdetail("A CloudEvents source is a URI reference: letters, digits and -._~:/?#@!$&'()*+,;= only, other characters percent-encoded (%%20 for a space).");
	outbox_note_refusal(OUTBOX_REFUSABLE_CE_SOURCE, source, "not a URI reference");
	return false;
}

static void
assign_ce_source(const char *newval, void *extra)
{
	outbox_clear_refusal(OUTBOX_REFUSABLE_CE_SOURCE);
}

/*
 * outbox.progress_topic must be a legal, non-empty topic name.
 */
static bool
check_progress_topic(char **newval, void **extra, GucSource source)
{
	size_t		len = strlen(*newval);

	if (len == 0 || len > OUTBOX_TOPIC_MAX_LEN ||
		!outbox_topic_chars_are_legal(*newval, len) ||
		strcmp(*newval, ".") == 0 || strcmp(*newval, "..") == 0)
	{
		GUC_check_errdetail("A topic name has 1 to %d ASCII letters, digits, '.', '_' and '-', and is not \".\" or \"..\".",
							OUTBOX_TOPIC_MAX_LEN);
		return false;
	}
	if (outbox_topic_is_internal(*newval))
	{
		GUC_check_errdetail("\"%s\" is one of Kafka's internal topics.", *newval);
		return false;
	}
	return true;
}

/*
 * The prefix is part of every routed topic name, so it may only contain
 * characters Kafka accepts in topic names, and must leave room for the
 * aggregate type.  The whole name is checked per event.
 */
static bool
check_topic_prefix(char **newval, void **extra, GucSource source)
{
	size_t		len = strlen(*newval);

	if (!outbox_topic_chars_are_legal(*newval, len))
	{
		GUC_check_errdetail("Topic names may only contain ASCII letters, digits, '.', '_' and '-'.");
		return false;
	}
	if (!outbox_topic_prefix_is_legal(*newval, len))
	{
		GUC_check_errdetail("The prefix leaves no room for the aggregate type in a topic name of at most %d characters.",
							OUTBOX_TOPIC_MAX_LEN);
		return false;
	}
	return true;
}

/*
 * True unless the bootstrap item (trimmed) ends in ":port" with a port that
 * is not a number from 1 to 65535.  An item without a port ("host",
 * "[::1]", "SSL://host") is valid: librdkafka uses 9092.
 */
static bool
bootstrap_port_is_valid(const char *item)
{
	size_t		end = strlen(item);
	size_t		colon;
	size_t		i;
	long		port = 0;

	/* the last ':' after any "scheme://" and any "[IPv6]" */
	for (colon = end; colon > 0 && item[colon - 1] != ':' && item[colon - 1] != ']' &&
		 item[colon - 1] != '/'; colon--)
		;
	if (colon == 0 || item[colon - 1] != ':')
		return true;			/* no port: librdkafka's default 9092 */
	if (colon == end)
		return false;
	for (i = colon; i < end; i++)
	{
		if (!isdigit((unsigned char) item[i]))
			return false;
		port = port * 10 + (item[i] - '0');
		if (port > 65535)
			return false;
	}
	return port >= 1;
}

/*
 * A list of host:port items separated by commas, or empty.  An empty item
 * (",,", a trailing comma) is refused: librdkafka would ignore it, and a
 * list of nothing but commas would leave the relay with no broker while
 * looking configured.  A port, when given, must be a number from 1 to
 * 65535 (librdkafka would read "kafka:notaport" as port 0 and only fail
 * to connect).  Which hosts the items name is librdkafka's business.
 */
bool
outbox_check_bootstrap_servers(char **newval, void **extra, GucSource source)
{
	List	   *items;
	ListCell   *lc;

	if (!split_list(pstrdup(*newval), &items))
	{
		GUC_check_errdetail("The list has an empty item; give host:port items separated by commas.");
		return false;
	}
	foreach(lc, items)
	{
		if (!bootstrap_port_is_valid((char *) lfirst(lc)))
		{
			GUC_check_errdetail("\"%s\" has no valid port; give host:port with a port from 1 to 65535.",
								(char *) lfirst(lc));
			return false;
		}
	}
	return true;
}

/*
 * Split a comma-separated list in place into its items, blanks around them
 * trimmed.  An empty list gives NIL; false if an item is empty (",,", a
 * trailing comma, blanks only), which the lists of outbox.bootstrap_servers
 * and outbox.allowed_topics refuse as a typo that would silently mean less
 * (or, for allowed_topics, more) than it says.
 */
static bool
split_list(char *list, List **items)
{
	char	   *next = list;

	*items = NIL;
	if (*list == '\0')
		return true;
	while (next != NULL)
	{
		char	   *item = next;
		char	   *comma = strchr(item, ',');

		next = comma ? comma + 1 : NULL;
		if (comma)
			*comma = '\0';
		item = outbox_trim_whitespace(item);
		if (*item == '\0')
			return false;
		*items = lappend(*items, item);
	}
	return true;
}

static void
assign_kafka_properties(const char *newval, void *extra)
{
	outbox_kafka_properties = extra ? (char *) extra : "";
	outbox_clear_refusal(OUTBOX_REFUSABLE_KAFKA_PROPERTIES);
}

/*
 * Every entry must be a legal topic name, or a prefix followed by '*'.  An
 * empty item (",,", a trailing comma) is refused like in
 * outbox.bootstrap_servers: it is a typo more often than not, and a list of
 * nothing but commas would allow every topic while looking restrictive.
 * The parsed list becomes the GUC's extra, kept by the GUC machinery.
 */
static bool
check_allowed_topics(char **newval, void **extra, GucSource source)
{
	List	   *items;
	char	   *list;
	const char *bad;

	if (!split_list(pstrdup(*newval), &items))
	{
		GUC_check_errdetail("The list has an empty item; give topic names or prefixes followed by * separated by commas, or an empty string to allow every topic.");
		return false;
	}
	/* the GUC machinery frees extras */
	list = outbox_guc_malloc(strlen(*newval) + 2);
	if (list == NULL)
		return false;
	bad = outbox_topic_list_pack(items, list);
	if (bad != NULL)
	{
		GUC_check_errdetail("\"%s\" is neither a legal Kafka topic name nor a prefix followed by *.", bad);
		outbox_guc_free(list);
		return false;
	}
	*extra = list;
	return true;
}

static void
assign_allowed_topics(const char *newval, void *extra)
{
	outbox_allowed_topic_list = (const char *) extra;
}
