/*-------------------------------------------------------------------------
 *
 * fault_point.c
 *	  A test hook: a fault at a named step of a relay batch, asked for by a
 *	  file in the data directory.  The crash and fault-schedule tests use
 *	  it to hit the few-microsecond windows that a signal sent at a random
 *	  time finds only rarely.
 *
 * The steps, in the order a batch passes them:
 *	claim_start			a batch of row-tracked events: its transaction's
 *						snapshot is taken, the claim not yet run (batch.c)
 *	snapshot_start		a snapshot batch: its transaction's snapshot is
 *						taken, the batch's own (cur) not yet (batch.c)
 *	mid_cursor			a chunk of the claim or snapshot cursor was produced,
 *						and the cursor may hold more (message.c)
 *	after_produce		every event of the batch was handed to librdkafka,
 *						no report awaited yet (batch.c)
 *	after_ack			every delivery report came, nothing marked (batch.c)
 *	mid_transaction		exactly_once: events and record acknowledged, the
 *						Kafka transaction still open (exactly_once.c)
 *	after_kafka_commit	exactly_once: Kafka committed, the database not
 *	before_commit		marked, the database's commit not yet done (batch.c)
 * and outside a batch:
 *	vacuum_start		the relay's VACUUM worker is connected, nothing
 *						vacuumed yet (vacuum.c)
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
 *	pass		nothing: the batch goes on (with sleep: a window held open
 *				at that step, for a test to commit something in it)
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
#include "storage/latch.h"
#include "utils/timestamp.h"
#include "utils/wait_event.h"

/*
 * Sleep ms milliseconds on the latch.  SIGTERM ends the sleep where
 * interrupts are not held (a VACUUM worker), as it would end the step the
 * sleep stands in front of; in a relay batch, which holds them, the sleep
 * goes on to its end.
 */
static void
sleep_interruptibly(int ms)
{
	TimestampTz end = TimestampTzPlusMilliseconds(GetCurrentTimestamp(), ms);
	long		left;

	while ((left = TimestampDifferenceMilliseconds(GetCurrentTimestamp(), end)) > 0)
	{
		(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
						 left, PG_WAIT_EXTENSION);
		ResetLatch(MyLatch);
		CHECK_FOR_INTERRUPTS();
	}
}

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
	if (strstr(order, "term") != NULL)
		action = "sending itself SIGTERM";
	else if (strstr(order, "error") != NULL)
		action = "raising an error";
	else if (strstr(order, "pass") != NULL)
		action = "going on";
	sleep_at = strstr(order, "sleep ");
	if (sleep_at == NULL || sscanf(sleep_at, "sleep %d", &sleep_ms) != 1 || sleep_ms < 0)
		sleep_ms = 0;
	sleep_ms = Min(sleep_ms, 60000);

	/* logged before the sleep: a test waits for this line to act in it */
	ereport(LOG,
			(errmsg("outbox relay: %s at \"%s\" after %d ms as asked by the file \"%s\"",
					action, moment, sleep_ms, path)));
	if (sleep_ms > 0)
		sleep_interruptibly(sleep_ms);
	if (strstr(order, "pass") != NULL)
		return;
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
