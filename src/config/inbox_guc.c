/*-------------------------------------------------------------------------
 *
 * inbox_guc.c
 *	  The outbox.inbox_* settings.
 *
 * Every one but outbox.inbox_max_workers (the size of an array in shared
 * memory) is PGC_SIGHUP: the inbox workers read them between batches and
 * before each handler call (inbox_handler.c), and rebuild their Kafka
 * consumers when a setting they were built with changed.
 * outbox.inbox_kafka_properties keeps its secrets out of view the way
 * outbox.kafka_properties does (kafka_config.c, secrets.c): its GUC
 * variable holds the masked value, the real one lives in the GUC's extra.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "config/inbox_guc.h"
#include "config/guc.h"
#include "config/guc_refusal.h"
#include "config/kafka_config.h"

#include <limits.h>

#include "miscadmin.h"
#include "utils/guc.h"

char	   *outbox_inbox_bootstrap_servers = NULL;
char	   *outbox_inbox_kafka_properties = "";
int			outbox_inbox_batch_size = 500;
int			outbox_inbox_batch_wait = 10;
int			outbox_inbox_handler_timeout = 30000;
int			outbox_inbox_dedupe_window = 7 * 24 * 3600;
int			outbox_inbox_max_attempts = 5;
bool		outbox_inbox_superuser_subscriptions = false;
int			outbox_inbox_workers_per_subscription = 1;
int			outbox_inbox_max_workers = 8;

/* the masked value SHOW displays (see the file header) */
static char *inbox_kafka_properties_masked = NULL;

/*
 * Consumer properties the inbox sets itself.  They carry the guarantees:
 * offsets live in the database, never in Kafka (no group, no commits, no
 * reset that would jump past records), and aborted records of a
 * transactional producer are never read.
 */
static const char *const inbox_reserved_properties[] = {
	"bootstrap.servers",
	"metadata.broker.list",
	"group.id",
	"group.instance.id",
	"enable.auto.commit",
	"enable.auto.offset.store",
	"auto.offset.reset",
	"isolation.level",
	"enable.partition.eof",
	"log.queue",
	"sasl.kerberos.min.time.before.relogin",
	NULL
};

static bool check_inbox_kafka_properties(char **newval, void **extra,
										 GucSource source);
static void assign_inbox_kafka_properties(const char *newval, void *extra);

/*
 * outbox_inbox_define_gucs
 *		Define the outbox.inbox_* settings; called by outbox_define_gucs()
 *		in every process that loads the library.
 */
void
outbox_inbox_define_gucs(void)
{
	DefineCustomStringVariable("outbox.inbox_bootstrap_servers",
							   "Kafka bootstrap servers (host:port,...) the inbox consumes from.",
							   "Empty means those of outbox.bootstrap_servers.",
							   &outbox_inbox_bootstrap_servers,
							   "",
							   PGC_SIGHUP,
							   0,
							   outbox_check_bootstrap_servers, NULL, NULL);

	DefineCustomStringVariable("outbox.inbox_kafka_properties",
							   "Extra librdkafka consumer properties of the inbox, as key=value;key=value.",
							   "Applied after the inbox's own defaults. Only superusers can see or set this.",
							   &inbox_kafka_properties_masked,
							   "",
							   PGC_SIGHUP,
							   GUC_SUPERUSER_ONLY,
							   check_inbox_kafka_properties,
							   assign_inbox_kafka_properties, NULL);

	DefineCustomIntVariable("outbox.inbox_batch_size",
							"Most records the inbox applies in one transaction.",
							"A handler error replays the batch without the failed record.",
							&outbox_inbox_batch_size,
							500, 1, 100000,
							PGC_SIGHUP,
							0,
							NULL, NULL, NULL);

	DefineCustomIntVariable("outbox.inbox_batch_wait",
							"How long the inbox waits to fill a batch once it has a record.",
							"0 applies what has arrived at once.",
							&outbox_inbox_batch_wait,
							10, 0, 10000,
							PGC_SIGHUP,
							GUC_UNIT_MS,
							NULL, NULL, NULL);

	DefineCustomIntVariable("outbox.inbox_handler_timeout",
							"Longest run of one handler call; a longer one fails with 57014 and becomes a dead letter.",
							"0 means no limit.",
							&outbox_inbox_handler_timeout,
							30000, 0, INT_MAX,
							PGC_SIGHUP,
							GUC_UNIT_MS,
							NULL, NULL, NULL);

	DefineCustomIntVariable("outbox.inbox_dedupe_window",
							"How long the inbox keeps the ids of applied events to drop copies of them.",
							"Ids are kept at least this long and at most twice it.",
							&outbox_inbox_dedupe_window,
							7 * 24 * 3600, 1, INT_MAX,
							PGC_SIGHUP,
							GUC_UNIT_S,
							NULL, NULL, NULL);

	DefineCustomIntVariable("outbox.inbox_max_attempts",
							"Attempts at a record that crashed the inbox worker or kept failing with a transient error before it becomes a dead letter.",
							NULL,
							&outbox_inbox_max_attempts,
							5, 1, 1000,
							PGC_SIGHUP,
							0,
							NULL, NULL, NULL);

	DefineCustomBoolVariable("outbox.inbox_superuser_subscriptions",
							 "Whether a superuser may subscribe, so that handlers run as a superuser.",
							 "Off: outbox.subscribe() refuses superusers and the inbox applies nothing for a subscription a superuser owns.",
							 &outbox_inbox_superuser_subscriptions,
							 false,
							 PGC_SIGHUP,
							 0,
							 NULL, NULL, NULL);

	DefineCustomIntVariable("outbox.inbox_workers_per_subscription",
							"Inbox apply workers per subscription, sharing its partitions.",
							"Each partition is applied by one of them, so the order of a key holds.",
							&outbox_inbox_workers_per_subscription,
							1, 1, OUTBOX_INBOX_MAX_WORKERS_PER_SUBSCRIPTION,
							PGC_SIGHUP,
							0,
							NULL, NULL, NULL);

	DefineCustomIntVariable("outbox.inbox_max_workers",
							"Most inbox apply workers in the whole server.",
							"Each takes a background worker (max_worker_processes) while it runs.",
							&outbox_inbox_max_workers,
							8, 1, 1024,
							/* as outbox.max_workers (guc.c) */
							process_shared_preload_libraries_in_progress ?
							PGC_POSTMASTER : PGC_SIGHUP,
							0,
							NULL, NULL, NULL);
}

/*
 * outbox_inbox_servers
 *		The bootstrap servers the inbox uses: outbox.inbox_bootstrap_servers,
 *		or outbox.bootstrap_servers when it is empty ("" when both are).
 */
const char *
outbox_inbox_servers(void)
{
	if (outbox_inbox_bootstrap_servers != NULL && outbox_inbox_bootstrap_servers[0] != '\0')
		return outbox_inbox_bootstrap_servers;
	return outbox_bootstrap_servers ? outbox_bootstrap_servers : "";
}

/*
 * outbox_inbox_reserved_properties
 *		The consumer properties the inbox sets itself (NULL-terminated).
 */
const char *const *
outbox_inbox_reserved_properties(void)
{
	return inbox_reserved_properties;
}

static bool
check_inbox_kafka_properties(char **newval, void **extra, GucSource source)
{
	return outbox_check_properties_setting(newval, extra, source,
										   inbox_reserved_properties, "the inbox",
										   "outbox.inbox_kafka_properties",
										   OUTBOX_REFUSABLE_INBOX_KAFKA_PROPERTIES);
}

static void
assign_inbox_kafka_properties(const char *newval, void *extra)
{
	outbox_inbox_kafka_properties = extra ? (char *) extra : "";
	outbox_clear_refusal(OUTBOX_REFUSABLE_INBOX_KAFKA_PROPERTIES);
}
