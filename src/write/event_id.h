/*-------------------------------------------------------------------------
 *
 * event_id.h
 *	  Time-ordered event ids: UUID version 7 (event_id.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_EVENT_ID_H
#define OUTBOX_EVENT_ID_H

#include "utils/uuid.h"

extern void outbox_uuidv7_generate(pg_uuid_t *uuid);

#endif							/* OUTBOX_EVENT_ID_H */
