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
 *-------------------------------------------------------------------------
 */
#include "outbox.h"

#include <ctype.h>
#include <limits.h>

#include "miscadmin.h"
#include "utils/guc.h"

char	   *outbox_database = NULL;
char	   *outbox_bootstrap_servers = NULL;
char	   *outbox_topic_prefix = NULL;
int			outbox_batch_size = 1000;
int			outbox_poll_interval = 1000;
char	   *outbox_kafka_properties = NULL;
int			outbox_retention = 60;
int			outbox_delivery_timeout = 30000;
int			outbox_retry_backoff_max = 30000;
int			outbox_max_attempts = 10;
int			outbox_on_failed_event = OUTBOX_ON_FAILED_HOLD;

static const struct config_enum_entry on_failed_event_options[] = {
	{"hold", OUTBOX_ON_FAILED_HOLD, false},
	{"skip", OUTBOX_ON_FAILED_SKIP, false},
	{NULL, 0, false}
};

static bool check_topic_prefix(char **newval, void **extra, GucSource source);
static bool check_kafka_properties(char **newval, void **extra,
								   GucSource source);

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
							   NULL, NULL, NULL);

	DefineCustomStringVariable("outbox.bootstrap_servers",
							   "Kafka bootstrap servers (host:port,...) the relay publishes to.",
							   "Empty means the relay worker idles and publishes nothing.",
							   &outbox_bootstrap_servers,
							   "",
							   PGC_SIGHUP,
							   0,
							   NULL, NULL, NULL);

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
							NULL,
							&outbox_batch_size,
							1000, 1, 100000,
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
							   "Applied after the relay's own defaults. Only superusers can see or set this.",
							   &outbox_kafka_properties,
							   "",
							   PGC_SIGHUP,
							   GUC_SUPERUSER_ONLY,
							   check_kafka_properties, NULL, NULL);

	DefineCustomIntVariable("outbox.retention",
							"How long published events are kept before the relay deletes them.",
							"-1 keeps them forever; 0 deletes them as soon as Kafka acknowledged them.",
							&outbox_retention,
							60, -1, INT_MAX,
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

	MarkGUCPrefixReserved("outbox");
}

/*
 * The prefix is part of every routed topic name, so it may only contain
 * characters Kafka accepts in topic names.  Length is checked per event,
 * together with the aggregate type.
 */
static bool
check_topic_prefix(char **newval, void **extra, GucSource source)
{
	const char *p;

	for (p = *newval; *p; p++)
	{
		if (!(isalnum((unsigned char) *p) || *p == '.' || *p == '_' || *p == '-') ||
			IS_HIGHBIT_SET(*p))
		{
			GUC_check_errdetail("Topic names may only contain ASCII letters, digits, '.', '_' and '-'.");
			return false;
		}
	}
	if (strlen(*newval) >= OUTBOX_TOPIC_MAX_LEN)
	{
		GUC_check_errdetail("The prefix leaves no room for the aggregate type in a topic name of at most %d characters.",
							OUTBOX_TOPIC_MAX_LEN);
		return false;
	}
	return true;
}

/*
 * Properties the relay sets itself and a user must not change: they carry
 * the delivery guarantees (acks, idempotence) or have their own GUC.
 */
static const char *const reserved_kafka_properties[] = {
	"bootstrap.servers",
	"metadata.broker.list",
	"enable.idempotence",
	"acks",
	"request.required.acks",
	"message.timeout.ms",
	"delivery.timeout.ms",
	"log.queue",
	NULL
};

static char *
trim_whitespace(char *s)
{
	char	   *end;

	while (*s && isspace((unsigned char) *s))
		s++;
	end = s + strlen(s);
	while (end > s && isspace((unsigned char) end[-1]))
		*--end = '\0';
	return s;
}

/*
 * outbox_parse_kafka_properties
 *		Split "key=value;key=value" into an array of properties.
 *
 * Empty items (";;" or a trailing ";") are ignored and whitespace around
 * keys and values is trimmed.  Values cannot contain ';'.  Returns false
 * with *error set (palloc'd) on a malformed item or a reserved key; the
 * librdkafka-level check of each value happens when the worker builds its
 * producer, because librdkafka must not be touched in the postmaster.
 * Results are palloc'd in the current memory context.
 */
bool
outbox_parse_kafka_properties(const char *text, OutboxKafkaProperty **props,
							  int *nprops, char **error)
{
	char	   *copy = pstrdup(text ? text : "");
	char	   *item;
	char	   *saveptr = NULL;
	int			n = 0;
	int			position = 0;
	int			cap = 8;
	OutboxKafkaProperty *out = palloc(sizeof(OutboxKafkaProperty) * cap);

	for (item = strtok_r(copy, ";", &saveptr); item != NULL;
		 item = strtok_r(NULL, ";", &saveptr))
	{
		char	   *eq;
		char	   *key;
		char	   *value;
		int			i;

		item = trim_whitespace(item);
		if (*item == '\0')
			continue;
		position++;

		/* messages never quote an item or a value: they may be secrets */
		eq = strchr(item, '=');
		if (eq == NULL)
		{
			*error = psprintf("item %d is not of the form key=value", position);
			return false;
		}
		*eq = '\0';
		key = trim_whitespace(item);
		value = trim_whitespace(eq + 1);
		if (*key == '\0')
		{
			*error = psprintf("item %d has an empty key", position);
			return false;
		}
		for (i = 0; reserved_kafka_properties[i] != NULL; i++)
		{
			if (pg_strcasecmp(key, reserved_kafka_properties[i]) == 0)
			{
				*error = psprintf("property \"%s\" is set by the relay itself and cannot be overridden", key);
				return false;
			}
		}
		if (n == cap)
		{
			cap *= 2;
			out = repalloc(out, sizeof(OutboxKafkaProperty) * cap);
		}
		out[n].key = key;
		out[n].value = value;
		n++;
	}
	*props = out;
	*nprops = n;
	return true;
}

/*
 * Reject a malformed outbox.kafka_properties when it is set, so that a typo
 * is reported by pg_reload_conf()'s log line and the old value stays in
 * effect.  The error text never includes the values: they may be secrets.
 */
static bool
check_kafka_properties(char **newval, void **extra, GucSource source)
{
	OutboxKafkaProperty *props;
	int			nprops;
	char	   *error = NULL;

	if (!outbox_parse_kafka_properties(*newval, &props, &nprops, &error))
	{
		/* replaces core's message, which would quote the whole value */
		GUC_check_errmsg("invalid value for parameter \"outbox.kafka_properties\"");
		GUC_check_errdetail("outbox.kafka_properties: %s.", error);
		return false;
	}
	return true;
}
