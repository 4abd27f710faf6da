/*-------------------------------------------------------------------------
 *
 * fault_point.c
 *	  A test hook: a fault at a named step of a relay batch, asked for by a
 *	  file in the data directory.  The crash and fault-schedule tests use
 *	  it to hit the few-microsecond windows that a signal sent at a random
 *	  time finds only rarely.
 *
 * The steps, in the order a batch passes them:
 *	mid_cursor			a chunk of the claim or snapshot cursor was produced,
 *						and the cursor may hold more (message.c)
 *	after_produce		every event of the batch was handed to librdkafka,
 *						no report awaited yet (batch.c)
 *	after_ack			every delivery report came, nothing marked (batch.c)
 *	mid_transaction		exactly_once: events and record acknowledged, the
 *						Kafka transaction still open (exactly_once.c)
 *	after_kafka_commit	exactly_once: Kafka committed, the database not
 *	before_commit		marked, the database's commit not yet done (batch.c)
 *
 * The file "outbox_crash_<step>" holds what to do, any of:
 *	relay <n>	only relay n of the database acts (first line)
 *	sleep <ms>	wait that long first, so that what is on the wire
 *				(delivery reports, a commit) arrives before the fault
 *	term		SIGTERM to this process, as a fast shutdown or
 *				pg_terminate_backend() sends: the batch goes on with
 *				ProcDiePending set and must stop without counting what it
 *				did not send as sent
 *	error		an ERROR at that step: the transaction is rolled back
 *	stop		SIGQUIT to the postmaster (pg_ctl stop -m immediate): the
 *				server comes back only when started again
 *	(nothing)	SIGKILL to this process: the postmaster restarts every
 *				backend, as after a crash
 * The file is removed when it acts, so one fault is one file.  Only the
 * data directory's owner can create it; without it a step costs one
 * failed fopen().
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "relay/fault_point.h"
#include "shared/partition.h"

#include <signal.h>
#include <unistd.h>

#include "miscadmin.h"

/*
 * outbox_fault_point
 *		Act on the file "outbox_crash_<moment>" of the data directory if it
 *		exists (see the file header); return at once otherwise.  moment is
 *		one of the step names above.  May not return (kill, stop), or raise
 *		ERROR (error).
 */
void
outbox_fault_point(const char *moment)
{
	char		path[MAXPGPATH];
	char		order[64] = "";
	FILE	   *file;
	int			relay;
	int			sleep_ms;
	const char *sleep_at;
	const char *action = "crashing";	/* kill and stop */

	snprintf(path, sizeof(path), "%s/outbox_crash_%s", DataDir, moment);
	file = fopen(path, "r");
	if (file == NULL)
		return;
	order[fread(order, 1, sizeof(order) - 1, file)] = '\0';
	fclose(file);
	if (sscanf(order, "relay %d", &relay) == 1 && relay != outbox_relay_worker + 1)
		return;
	if (unlink(path) != 0)
		return;					/* another relay came first */
	sleep_at = strstr(order, "sleep ");
	if (sleep_at != NULL && sscanf(sleep_at, "sleep %d", &sleep_ms) == 1 && sleep_ms > 0)
		pg_usleep(Min(sleep_ms, 60000) * 1000L);
	if (strstr(order, "term") != NULL)
		action = "sending itself SIGTERM";
	else if (strstr(order, "error") != NULL)
		action = "raising an error";
	ereport(LOG,
			(errmsg("outbox relay: %s at \"%s\" as asked by the file \"%s\"",
					action, moment, path)));
	if (strstr(order, "term") != NULL)
	{
		(void) kill(getpid(), SIGTERM);
		return;
	}
	if (strstr(order, "error") != NULL)
		ereport(ERROR,
				(errcode(ERRCODE_INTERNAL_ERROR),
				 errmsg("outbox relay: an error injected at \"%s\"", moment)));
	if (strstr(order, "stop") != NULL)
	{
		(void) kill(PostmasterPid, SIGQUIT);
		for (;;)
			pg_usleep(100000L); /* the postmaster's SIGQUIT ends this process */
	}
	(void) kill(getpid(), SIGKILL);
}
