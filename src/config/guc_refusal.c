/*-------------------------------------------------------------------------
 *
 * guc_refusal.c
 *	  Settings whose value the server refused when it started.
 *
 * A malformed value in postgresql.conf (or on the command line, -c) when
 * the server starts is only a WARNING for PostgreSQL, which then starts with
 * the setting's default.  For some settings the default is worse than no
 * relay at all: without its outbox.kafka_properties the relay would connect
 * without the TLS or SASL settings it was given; with the default
 * outbox.message_format or outbox.ce_source, consumers would get messages
 * of another shape or source than they were built for.  So their check
 * hooks note such a refusal here, and the relay publishes nothing while one
 * stands (worker.c, ensure_producer).
 *
 * A refusal is inherited by the relay (it happens in the postmaster), is
 * cleared when a value of that setting is accepted (its assign hook), and,
 * for a refusal from the file only, by a reload that refuses none of that
 * setting's values (the line fixed, or removed so that the default applies,
 * which calls no assign hook).  A refused command-line value stays refused
 * until a valid value is loaded: no reload can bring the command line back.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "config/guc_refusal.h"

#include "miscadmin.h"
#include "utils/guc.h"

typedef struct Refusal
{
	const char *name;			/* the setting */
	char		why[256];		/* "" = not refused; never holds a secret */
	bool		on_command_line;
	uint64		file_refusals;	/* values from a configuration file refused */
} Refusal;

static Refusal refusals[OUTBOX_NUM_REFUSABLE] = {
	[OUTBOX_REFUSABLE_KAFKA_PROPERTIES] = {"outbox.kafka_properties"},
	[OUTBOX_REFUSABLE_MESSAGE_FORMAT] = {"outbox.message_format"},
	[OUTBOX_REFUSABLE_CE_SOURCE] = {"outbox.ce_source"},
	[OUTBOX_REFUSABLE_INBOX_KAFKA_PROPERTIES] = {"outbox.inbox_kafka_properties"},
};

/*
 * outbox_note_refusal
 *		Called by setting's check hook when it refuses a value from source;
 *		why says what was wrong, without the value if it may be secret.
 *		Only refusals from the file or the command line count, and only at
 *		server start for the standing refusal.
 */
void
outbox_note_refusal(OutboxRefusable setting, GucSource source, const char *why)
{
	Refusal    *r = &refusals[setting];

	if (source == PGC_S_FILE)
		r->file_refusals++;
	if (process_shared_preload_libraries_in_progress &&
		(source == PGC_S_FILE || source == PGC_S_ARGV))
	{
		strlcpy(r->why, why, sizeof(r->why));
		if (source == PGC_S_ARGV)
			r->on_command_line = true;
	}
}

/*
 * outbox_clear_refusal
 *		Called by setting's assign hook: a value was accepted.
 */
void
outbox_clear_refusal(OutboxRefusable setting)
{
	refusals[setting].why[0] = '\0';
	refusals[setting].on_command_line = false;
}

/*
 * outbox_config_refusal
 *		The first standing refusal as a sentence for the log and the status
 *		("outbox.message_format in the configuration file was refused when
 *		the server started (...)"), palloc'd; NULL if none stands.
 */
char *
outbox_config_refusal(void)
{
	int			i;

	for (i = 0; i < OUTBOX_NUM_RELAY_REFUSABLE; i++)
		if (refusals[i].why[0] != '\0')
			return psprintf("%s in the configuration file was refused when the server started (%s); the relay publishes nothing without the settings it was given",
							refusals[i].name, refusals[i].why);
	return NULL;
}

/*
 * outbox_refusal_of
 *		The standing refusal of one setting as a sentence (see
 *		outbox_config_refusal), palloc'd; NULL if it stands not.  The inbox
 *		asks for its own settings this way.
 */
char *
outbox_refusal_of(OutboxRefusable setting)
{
	if (refusals[setting].why[0] == '\0')
		return NULL;
	return psprintf("%s in the configuration file was refused when the server started (%s); the inbox consumes nothing without the settings it was given",
					refusals[setting].name, refusals[setting].why);
}

/*
 * outbox_reload_config_file
 *		ProcessConfigFile(PGC_SIGHUP) for the relay and the launcher; then
 *		forget the refusals from the file that this reload did not repeat.
 */
void
outbox_reload_config_file(void)
{
	uint64		before[OUTBOX_NUM_REFUSABLE];
	int			i;

	for (i = 0; i < OUTBOX_NUM_REFUSABLE; i++)
		before[i] = refusals[i].file_refusals;
	ProcessConfigFile(PGC_SIGHUP);
	for (i = 0; i < OUTBOX_NUM_REFUSABLE; i++)
		if (refusals[i].file_refusals == before[i] && !refusals[i].on_command_line)
			refusals[i].why[0] = '\0';
}
